"""The JSONL audit log: one line per scored (or failed) episode, written off the event loop.

The audit log never touches the disk on the event loop: `write` only puts the line on a bounded
queue; one writer thread appends, and rotates by size. A line that cannot be queued (the disk
cannot keep up) or written (an OS error) is counted, logged and shown on /health, and the score is
answered all the same: the log serves the report, never the reward.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from proxy.metrics import Metrics

log = logging.getLogger("vlm_reward_proxy.audit")

_STOP = object()  # tells the writer thread to end, after every line queued before it


class AuditLog:
    """One JSON line per scored (or failed) episode. No media: hashes only.

    `write` (on the loop) serialises and queues the line, never blocking; the writer thread
    appends it and rotates the file past `max_bytes` (file -> file.1 -> ... -> file.<keep>, the
    oldest deleted). `flush` waits until every line queued so far is on disk (the kernel's, not
    fsync'd); `close` flushes and ends the thread (the app's lifespan, at a clean stop)."""

    def __init__(self, path: Path | None, *, max_bytes: int | None = None, keep: int = 10,
                 queue_lines: int = 10_000, metrics: Metrics | None = None) -> None:
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self._metrics = metrics
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_lines)
        self.written = 0
        self.dropped: collections.Counter[str] = collections.Counter()  # reason -> lines
        self.error: str | None = None  # the last write failure, until a write succeeds
        self._thread: threading.Thread | None = None
        self._fh: Any = None  # the writer thread's own: the open file and its size
        self._size = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
            self._thread.start()

    def write(self, record: dict[str, Any]) -> None:
        if self._thread is None:
            return
        line = json.dumps({"ts": round(time.time(), 3), **record}, separators=(",", ":")) + "\n"
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self._drop("queue_full", 1, f"the writer is {self._queue.maxsize} lines behind (audit.queue_lines)")

    def status(self) -> dict[str, Any]:
        """/health's `audit` entry."""
        return {"path": str(self.path), "queued": self._queue.qsize(), "written": self.written,
                "dropped": sum(self.dropped.values()), "dropped_by_reason": dict(self.dropped), "error": self.error}

    def flush(self) -> None:
        """Block until every line queued before this call was written (or counted as dropped)."""
        if self._thread is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then end the writer thread. Blocking: call it off the loop."""
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join()
            self._thread = None

    def _drop(self, reason: str, lines: int, why: str) -> None:
        if not self.dropped[reason]:
            log.error("audit log %s: %s; lost lines are counted (vlm_proxy_audit_dropped_total, /health)",
                      self.path, why)
        self.dropped[reason] += lines
        if self._metrics is not None:
            self._metrics.audit_dropped.labels(reason).inc(lines)

    def _run(self) -> None:
        try:
            while True:
                batch = [self._queue.get()]
                while batch[-1] is not _STOP:  # take what else is waiting
                    try:
                        batch.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                lines, before = [line for line in batch if line is not _STOP], self.written
                try:
                    self._append(lines)
                except OSError as err:
                    self.error = f"{type(err).__name__}: {err}"
                    self._drop("os_error", len(lines) - (self.written - before), f"writing failed ({self.error})")
                    self._close_file()  # opened afresh for the next line
                finally:
                    for _ in batch:
                        self._queue.task_done()
                if self._metrics is not None:
                    self._metrics.audit_queued.set(self._queue.qsize())
                if batch[-1] is _STOP:
                    return
        finally:
            self._close_file()

    def _append(self, lines: list[str]) -> None:
        if not lines:
            return
        fh = self._current()
        for line in lines:
            data = line.encode()
            if self.max_bytes is not None and self._size and self._size + len(data) > self.max_bytes:
                self._close_file()
                self._rotate()
                fh = self._current()
            fh.write(data)  # unbuffered: a line counted as written is in the file
            self._size += len(data)
            self.written += 1
        self.error = None

    def _current(self) -> Any:
        """The open file; opened afresh when it was moved or deleted (an outside rotator's doing)."""
        assert self.path is not None
        if self._fh is not None:
            try:
                moved = os.stat(self.path).st_ino != os.fstat(self._fh.fileno()).st_ino
            except OSError:
                moved = True
            if moved:
                self._close_file()
        if self._fh is None:
            self._fh = self.path.open("ab", buffering=0)
            self._size = os.fstat(self._fh.fileno()).st_size
        return self._fh

    def _close_file(self) -> None:
        if self._fh is not None:
            with contextlib.suppress(OSError):
                self._fh.close()
            self._fh = None

    def _rotate(self) -> None:
        """file -> file.1, file.1 -> file.2, ...; file.<keep> is deleted (readers: reports/audit_lines.py)."""
        assert self.path is not None
        rotated = [self.path.with_name(f"{self.path.name}.{n}") for n in range(self.keep + 1)]
        rotated[0] = self.path
        rotated[-1].unlink(missing_ok=True)
        for n in range(self.keep - 1, -1, -1):
            if rotated[n].exists():
                rotated[n].replace(rotated[n + 1])
