"""The bounded, persistent reference store of POST /progress/batch: per task, the embeddings of
earlier successes (oldest evicted first) and of user-supplied demonstrations (never evicted;
adding beyond the cap is an error), under at most `max_keys` keys: callers name namespaces and
tasks, so a new key beyond the cap is refused (ReferenceKeysFull) while the keys held keep working.

A task's references are kept under a `StoreKey`: the served model, the embedding space (what else
decides a vector: layout, prompt, frame limits and rate — proxy/progress/pipeline.py fingerprints it), an
optional namespace (one training run's successes are not another's) and the task id. Vectors
under another key are never mixed in. One `.npz` per key, written to a temporary file, fsynced and
renamed (a reader never sees half a file), validated when loaded at start (a file that is not what
this module writes is logged and ignored). Writes run on a worker thread (asyncio.to_thread); one
lock keeps each change whole: a change is written first and kept in memory only once written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from proxy.config.stores import ReferenceStoreConfig
from proxy.errors import ReferenceKeysFull, ReferenceMismatch, ReferenceStoreFull

__all__ = ["ReferenceStore", "StoreKey"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreKey:
    model: str
    space: str
    namespace: str
    task: str

    @property
    def file_name(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32] + ".npz"


@dataclass(frozen=True)
class _Held:
    successes: tuple[np.ndarray, ...] = ()
    demonstrations: tuple[np.ndarray, ...] = ()

    @property
    def dim(self) -> int | None:
        rows = self.demonstrations or self.successes
        return len(rows[0]) if rows else None


class ReferenceStore:
    def __init__(self, cfg: ReferenceStoreConfig) -> None:
        self.cfg = cfg
        self._held: dict[StoreKey, _Held] = {}
        self._lock = threading.Lock()

    def open(self) -> None:
        """Create the directory and load every task file, trimmed to today's caps."""
        self.cfg.dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.cfg.dir.glob("*.npz")):
            try:
                key, held = self._read(path)
            except (OSError, ValueError, KeyError, TypeError) as err:
                log.warning("reference store: %s is not a reference file (%s); it is ignored", path, err)
                continue
            self._held[key] = _Held(held.successes[len(held.successes) - self.cfg.max_successes:]
                                    if self.cfg.max_successes else (), held.demonstrations)
        if len(self._held) > self.cfg.max_keys:  # all kept (nothing is lost); no new key until below the cap
            log.warning("reference store: %d keys in %s, more than reference_store.max_keys (%d): every one is "
                        "kept, no new (namespace, task) is added", len(self._held), self.cfg.dir, self.cfg.max_keys)

    def references(self, key: StoreKey, dim: int) -> np.ndarray:
        """The task's stored vectors (demonstrations, then successes), rows of `dim` numbers."""
        with self._lock:
            held = self._held.get(key, _Held())
        rows = [*held.demonstrations, *held.successes]
        if rows and len(rows[0]) != dim:
            raise ReferenceMismatch(
                f"the reference store holds {len(rows[0])}-number vectors for task {key.task!r} of model "
                f"{key.model!r}, but the model now answers {dim}: the checkpoint changed under its name; "
                f"remove {self.cfg.dir / key.file_name}", task_id=key.task)
        return np.asarray(rows, dtype=np.float64).reshape(len(rows), dim)

    def count(self, key: StoreKey) -> int:
        """How many references (demonstrations and successes) the key holds now."""
        with self._lock:
            held = self._held.get(key, _Held())
        return len(held.demonstrations) + len(held.successes)

    def add_successes(self, key: StoreKey, vectors: list[np.ndarray]) -> None:
        if not vectors or self.cfg.max_successes == 0:
            return
        with self._lock:
            held = self._held_or_new(key)
            kept = _new_rows(held, vectors)
            successes = (*held.successes, *kept)[-self.cfg.max_successes:]
            self._commit(key, _Held(successes, held.demonstrations))

    def add_demonstrations(self, key: StoreKey, vectors: list[np.ndarray]) -> tuple[int, int]:
        """Adds them all (but exact repeats, which would make a cluster of one episode) or none;
        returns how many were added and how many the task now holds."""
        with self._lock:
            held = self._held_or_new(key)
            kept = _new_rows(held, vectors)
            if len(held.demonstrations) + len(kept) > self.cfg.max_demonstrations:
                raise ReferenceStoreFull(
                    f"task {key.task!r} holds {len(held.demonstrations)} demonstrations; {len(kept)} more would "
                    f"exceed reference_store.max_demonstrations ({self.cfg.max_demonstrations})", task_id=key.task)
            self._commit(key, _Held(held.successes, (*held.demonstrations, *kept)))
            return len(kept), len(held.demonstrations) + len(kept)

    def _held_or_new(self, key: StoreKey) -> _Held:
        """The key's references, or none for a new key if the store has room for one (lock held)."""
        held = self._held.get(key)
        if held is not None:
            return held
        if len(self._held) >= self.cfg.max_keys:
            raise ReferenceKeysFull(
                f"the reference store holds {len(self._held)} (namespace, task) keys, reference_store.max_keys: "
                f"task {key.task!r} of namespace {key.namespace!r} is not added (the keys held keep working)",
                task_id=key.task, namespace=key.namespace)
        return _Held()

    def status(self) -> dict[str, Any]:
        with self._lock:
            tasks = [{"model": k.model, "space": k.space, "namespace": k.namespace, "task_id": k.task,
                      "successes": len(h.successes), "demonstrations": len(h.demonstrations), "dim": h.dim}
                     for k, h in self._held.items()]
        return {"dir": str(self.cfg.dir), "max_successes": self.cfg.max_successes,
                "max_demonstrations": self.cfg.max_demonstrations, "max_keys": self.cfg.max_keys, "tasks": tasks}

    def _commit(self, key: StoreKey, held: _Held) -> None:
        """On disk first; in memory only once written (a failed write changes nothing)."""
        path, dim = self.cfg.dir / key.file_name, held.dim or 0
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # never matches *.npz
        try:
            with open(tmp, "wb") as out:
                np.savez(out, meta=np.array(json.dumps(asdict(key))),
                         successes=np.asarray(held.successes, dtype=np.float64).reshape(-1, dim),
                         demonstrations=np.asarray(held.demonstrations, dtype=np.float64).reshape(-1, dim))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self._held[key] = held

    @staticmethod
    def _read(path: Path) -> tuple[StoreKey, _Held]:
        with np.load(path, allow_pickle=False) as data:
            key = StoreKey(**{k: str(v) for k, v in json.loads(str(data["meta"])).items()})
            arrays = [np.asarray(data[name]) for name in ("successes", "demonstrations")]
        if path.name != key.file_name:
            raise ValueError(f"its key belongs in {key.file_name}")
        widths = {a.shape[1] for a in arrays if a.ndim == 2 and len(a)}
        if any(a.ndim != 2 or a.dtype != np.float64 or not np.isfinite(a).all() for a in arrays) or len(widths) > 1:
            raise ValueError("successes and demonstrations must be finite float64 rows of one width")
        return key, _Held(tuple(arrays[0]), tuple(arrays[1]))


def _new_rows(held: _Held, vectors: list[np.ndarray]) -> list[np.ndarray]:
    """The vectors not held yet (nor repeated in `vectors`), checked to be one finite width that
    matches the task's."""
    widths = {len(v) for v in vectors} | ({held.dim} if held.dim else set())
    if len(widths) > 1 or not all(np.isfinite(v).all() for v in vectors):
        raise ReferenceMismatch(f"vectors of widths {sorted(widths)} (or not finite) cannot join one task's "
                                "references: did the checkpoint change under its name?")
    seen = {v.tobytes() for v in (*held.successes, *held.demonstrations)}
    kept = []
    for vector in vectors:
        if vector.tobytes() not in seen:
            seen.add(vector.tobytes())
            kept.append(np.asarray(vector, dtype=np.float64))
    return kept
