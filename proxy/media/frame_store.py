"""The opt-in frame store: each JPEG sent to vLLM, written once under its content hash.

It serves the audit log (the report's contact sheets, `replay`), never the score: a full store or a
failing disk is counted, logged once per change of state, shown on /health and in the audit line,
and the episode is scored all the same. The bytes are the ones sent (no re-encode); a file is
written under a temporary name and renamed, so a reader never sees half a JPEG.

A slow or hung disk (NFS) must not stall scoring: writes run on the store's own thread (the shared
thread pool, which decodes frames, is never blocked by it), an episode waits for them at most
WAIT_S, and at most MAX_BACKLOG episodes' frames wait in memory; beyond either, the episode is
scored and its audit line says the frames were not kept."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from proxy.config.stores import FrameStoreConfig
from proxy.metrics import Metrics
from vlm_protocol.frame_store import frame_path

log = logging.getLogger(__name__)
WAIT_S = 2.0
MAX_BACKLOG = 32


@dataclass(frozen=True)
class StoreOutcome:
    """What one episode's frames did in the store: the audit line's `frame_store` entry."""

    written: int  # new files
    present: int  # already stored (the same bytes from an earlier episode)
    error: str | None = None  # why some were not stored; they are still scored

    def record(self) -> dict:
        return {"written": self.written, "present": self.present, "error": self.error}


class FrameStore:
    def __init__(self, config: FrameStoreConfig, metrics: Metrics) -> None:
        self.root = config.dir
        self.cap_bytes = int(config.max_mb * 2**20)
        self.metrics = metrics
        self._lock = threading.Lock()
        self._used = 0
        self._backlog = 0  # episodes whose writes are queued or running
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="frame-store")
        self.last_error: str | None = None

    def open(self) -> None:
        """Create the directory and count what it already holds (so the cap spans restarts);
        temporary files a crash left behind are removed, not counted."""
        self.root.mkdir(parents=True, exist_ok=True)
        used = 0
        for sub in (s for s in self.root.iterdir() if s.is_dir()):
            for entry in os.scandir(sub):
                if entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                elif entry.is_file():
                    used += entry.stat().st_size
        self._used = used
        self.metrics.frame_store_bytes.set(self._used)

    def close(self) -> None:
        self._writer.shutdown(wait=False, cancel_futures=True)

    async def put(self, jpegs: list[bytes], hashes: list[str]) -> StoreOutcome:
        if self._backlog >= MAX_BACKLOG:
            return StoreOutcome(0, 0, self._failed("backlog", f"{MAX_BACKLOG} episodes are still waiting "
                                                              "for the disk; these frames were not kept"))
        self._backlog += 1
        writing = asyncio.get_running_loop().run_in_executor(self._writer, self._put_all, jpegs, hashes)
        writing.add_done_callback(self._written)
        try:
            return await asyncio.wait_for(asyncio.shield(writing), WAIT_S)
        except TimeoutError:
            return StoreOutcome(0, 0, self._failed("slow", f"the disk took longer than {WAIT_S:g} s; the "
                                                           "frames are written later if it recovers"))

    def _written(self, _future: asyncio.Future) -> None:
        self._backlog -= 1

    def status(self) -> dict:
        # no directory: /health is unauthenticated, and the path is in the proxy's log and config
        return {"used_mb": round(self._used / 2**20, 3), "max_mb": round(self.cap_bytes / 2**20, 3),
                "last_error": self.last_error, "backlog": self._backlog}

    def _put_all(self, jpegs: list[bytes], hashes: list[str]) -> StoreOutcome:
        written = present = 0
        error = None
        for data, digest in zip(jpegs, hashes, strict=True):
            path = frame_path(self.root, digest)
            if path.exists():
                present += 1
                continue
            try:
                self._write(path, data)
            except _Full as err:
                error = self._failed("full", str(err))
                break  # the rest would not fit either
            except OSError as err:
                error = self._failed("os_error", f"{type(err).__name__}: {err.strerror or err}")
                break
            written += 1
        if error is None and self.last_error is not None:
            log.warning("frame store %s writes again", self.root)
            self.last_error = None
        return StoreOutcome(written, present, error)

    def _write(self, path: Path, data: bytes) -> None:
        with self._lock:
            if self._used + len(data) > self.cap_bytes:
                raise _Full(f"the frame store is full ({self._used / 2**20:.1f} of "
                            f"{self.cap_bytes / 2**20:.1f} MB, proxy.frame_store.max_mb)")
            self._used += len(data)  # reserved before the write, so concurrent writers cannot overshoot
        tmp = path.with_name(f".{path.name}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError:
            with self._lock:
                self._used -= len(data)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self.metrics.frame_store_bytes.set(self._used)

    def _failed(self, reason: str, message: str) -> str:
        self.metrics.frame_store_errors.labels(reason).inc()
        if message != self.last_error:
            log.warning("frame store: %s; episodes are still scored, their frames are not kept", message)
        self.last_error = message
        return message


class _Full(Exception):
    pass
