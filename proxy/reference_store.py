"""The bounded, persistent reference store of POST /progress/batch: per (served model, task), the
embeddings of earlier successes (oldest evicted first) and of user-supplied demonstrations
(never evicted; adding beyond the cap is an error).

One `.npz` per task, written under a temporary name and renamed (a reader never sees half a
file), loaded when the proxy starts. Keyed by the served model name: vectors of another model
mean nothing here. Writes run on a worker thread (asyncio.to_thread); one lock keeps them whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proxy.config import ReferenceStoreConfig
from proxy.errors import ReferenceMismatch, ReferenceStoreFull

__all__ = ["ReferenceStore"]

log = logging.getLogger(__name__)


@dataclass
class _Task:
    model: str
    task: str
    successes: list[np.ndarray] = field(default_factory=list)
    demonstrations: list[np.ndarray] = field(default_factory=list)

    @property
    def dim(self) -> int | None:
        held = self.demonstrations or self.successes
        return len(held[0]) if held else None


class ReferenceStore:
    def __init__(self, cfg: ReferenceStoreConfig) -> None:
        self.cfg = cfg
        self._tasks: dict[tuple[str, str], _Task] = {}
        self._lock = threading.Lock()

    def open(self) -> None:
        """Create the directory and load every task file (a broken file is logged and left alone)."""
        self.cfg.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.cfg.dir.glob("*.npz")):
            try:
                with np.load(path, allow_pickle=False) as data:
                    meta = json.loads(str(data["meta"]))
                    entry = _Task(meta["model"], meta["task"], list(data["successes"]), list(data["demonstrations"]))
            except (OSError, ValueError, KeyError) as err:
                log.warning("reference store: cannot read %s (%s); it is ignored", path, err)
                continue
            self._tasks[(entry.model, entry.task)] = entry

    def references(self, model: str, task: str, dim: int) -> np.ndarray:
        """The task's stored vectors (demonstrations, then successes), rows of `dim` numbers."""
        with self._lock:
            entry = self._tasks.get((model, task))
            rows = [*entry.demonstrations, *entry.successes] if entry else []
        if rows and len(rows[0]) != dim:
            raise ReferenceMismatch(
                f"the reference store holds {len(rows[0])}-number vectors for task {task!r} of model {model!r}, "
                f"but the model now answers {dim}: remove {self._path(model, task)} (the model changed)",
                task_id=task)
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), dim)

    def add_successes(self, model: str, task: str, vectors: list[np.ndarray]) -> None:
        if not vectors or self.cfg.max_successes == 0:
            return
        with self._lock:
            entry = self._entry(model, task, len(vectors[0]))
            entry.successes = [*entry.successes, *vectors][-self.cfg.max_successes:]
            self._write(entry)

    def add_demonstrations(self, model: str, task: str, vectors: list[np.ndarray]) -> int:
        """Adds them all or none; returns how many the task now holds."""
        with self._lock:
            entry = self._entry(model, task, len(vectors[0]))
            if len(entry.demonstrations) + len(vectors) > self.cfg.max_demonstrations:
                raise ReferenceStoreFull(
                    f"task {task!r} holds {len(entry.demonstrations)} demonstrations; {len(vectors)} more would "
                    f"exceed reference_store.max_demonstrations ({self.cfg.max_demonstrations})", task_id=task)
            entry.demonstrations = [*entry.demonstrations, *vectors]
            self._write(entry)
            return len(entry.demonstrations)

    def status(self) -> dict[str, Any]:
        with self._lock:
            tasks = [{"model": e.model, "task_id": e.task, "successes": len(e.successes),
                      "demonstrations": len(e.demonstrations), "dim": e.dim} for e in self._tasks.values()]
        return {"dir": str(self.cfg.dir), "max_successes": self.cfg.max_successes,
                "max_demonstrations": self.cfg.max_demonstrations, "tasks": tasks}

    def _entry(self, model: str, task: str, dim: int) -> _Task:
        entry = self._tasks.setdefault((model, task), _Task(model, task))
        if entry.dim is not None and entry.dim != dim:
            raise ReferenceMismatch(f"task {task!r} of model {model!r} holds {entry.dim}-number vectors; these have "
                                    f"{dim}: remove {self._path(model, task)} (the model changed)", task_id=task)
        return entry

    def _path(self, model: str, task: str):
        return self.cfg.dir / (hashlib.sha256(f"{model}\0{task}".encode()).hexdigest()[:32] + ".npz")

    def _write(self, entry: _Task) -> None:
        path, dim = self._path(entry.model, entry.task), entry.dim or 0
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, meta=np.array(json.dumps({"model": entry.model, "task": entry.task})),
                 successes=np.asarray(entry.successes, dtype=np.float64).reshape(-1, dim),
                 demonstrations=np.asarray(entry.demonstrations, dtype=np.float64).reshape(-1, dim))
        os.replace(tmp, path)
