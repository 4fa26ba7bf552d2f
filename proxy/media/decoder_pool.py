"""The supervised processes that decode video files: one request's video job
(proxy/media/decode_jobs.py) runs in one of them, and what can go wrong there costs that request only.

Invariants:
- Every job that reads a video file runs here (`MediaExecutor.run_job`); inline images and `.npy`
  arrays stay on the media threads (docs/benchmarks.md §9: threads are ahead of processes there).
- A process gets the job as data and the files as descriptors the proxy opened and checked
  (`socket.sendmsg` with SCM_RIGHTS, via multiprocessing's `send_handle`): it never opens a path,
  so the no-follow, regular-file and under-a-root checks of proxy/media/file.py hold as they did.
  It sends back JPEG bytes and their metadata, never decoded frames.
- A process killed by a signal (a decoder's memory bug, the kernel's OOM killer), past its
  address-space limit or past `task_timeout_s` answers its request with 422 `media_decoder_failed`
  naming the file and the cause, and is replaced; nothing is retried (the file did it). Requests on
  the other processes go on: each process has its own pipe and is watched on its own. That is why
  this is not `concurrent.futures.ProcessPoolExecutor`: when one of its workers dies it marks the
  whole pool broken and fails every task in flight and queued with `BrokenProcessPool`.
- Processes come from a forkserver (never a fork of the running, threaded proxy) that has
  imported the decoder once, started on the first video: a proxy that decodes no video starts
  none. There are at most `proxy.media_workers` (each media thread uses one at a time); a process
  is replaced after `tasks_per_process` jobs, and when the request's caller is gone it is killed
  rather than left decoding for no one.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.reduction import send_handle
from typing import Any

from proxy.config.video_decoders import VideoDecodersConfig
from proxy.errors import MediaDecoderFailed, ProxyError
from proxy.media.budget import DecodeBudget, DecodeCancelled, MediaCaps
from proxy.media.decode_jobs import Curve, CurveJob, Job
from proxy.media.decoder_process import WorkerLimits, serve
from proxy.media.encode import EncodedFrames
from proxy.media.file import OpenedVideo

__all__ = ["DecoderPool"]

log = logging.getLogger(__name__)
_JOIN_S = 5.0  # a killed process is reaped at once; a retired one exits when its pipe closes
_PRELOAD = ["proxy.media.decoder_process"]  # OpenCV and the decode path, imported once by the forkserver


class _Worker:
    def __init__(self, context, config: VideoDecodersConfig) -> None:
        self.conn, child = context.Pipe(duplex=True)
        self.process = context.Process(target=serve, name="vlm-video-decoder", daemon=True,
                                       args=(child, WorkerLimits(int(config.max_memory_mb * 2**20))))
        try:
            self.process.start()
        finally:
            child.close()
        self.tasks = 0
        self.killed = False  # a killed worker is never given a job again, reaped or not

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(OSError, ValueError):
            self.process.kill()

    def usable(self) -> bool:
        return not self.killed and self.process.is_alive()

    def close(self, *, kill: bool = False) -> None:
        """Stop the process (closing its pipe ends its loop; `kill` for one that may be busy) and reap it."""
        if kill:
            self.kill()
        self.conn.close()
        self.process.join(_JOIN_S)
        if self.process.exitcode is None:
            self.kill()
            self.process.join(_JOIN_S)
        self.process.close()


class DecoderPool:
    """`run` is blocking: a media thread calls it and waits for its process."""

    def __init__(self, config: VideoDecodersConfig, processes: int) -> None:
        self.config, self.processes = config, processes
        self._context = multiprocessing.get_context("forkserver")
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.started = 0  # processes started, replacements included
        self.failed = 0  # jobs answered media_decoder_failed

    def run(self, job: Job, videos: list[OpenedVideo], parts: dict[str, bytes], caps: MediaCaps,
            budget: DecodeBudget) -> EncodedFrames | Curve:
        worker = self._take()
        keep = False
        forget_cancel = budget.on_cancel(worker.kill)
        try:
            cause = self._send(worker, job, videos, parts, caps)
            if cause is None:
                ready = wait([worker.conn, worker.process.sentinel], self.config.task_timeout_s)
                reply = None
                if worker.conn in ready:
                    with contextlib.suppress(EOFError, OSError):
                        reply = worker.conn.recv()
                if reply is not None:
                    kind, value = reply
                    keep = kind in ("ok", "error")
                    if kind == "ok":
                        return value
                    if kind == "error":
                        raise _rebuilt(*value)
                    if kind == "bug":
                        raise RuntimeError(f"the video decoder process failed:\n{value}")
                    cause = ("memory", f"went past its memory limit ({value})")
                elif not ready:
                    worker.kill()
                    cause = ("timeout", f"took longer than proxy.video_decoders.task_timeout_s "
                                        f"({self.config.task_timeout_s:g} s)")
                else:
                    cause = self._death(worker)
            if budget.cancelled.is_set():
                raise DecodeCancelled
            self.failed += 1
            names = " and ".join(video.name for video in videos)
            log.warning("video decoder process failed on %s: %s", names, cause[1])
            raise MediaDecoderFailed(f"{names}: the video decoder process {cause[1]}; the file is refused "
                                     "(not retried)", field="video_path", cause=cause[0])
        finally:
            forget_cancel()
            self._give_back(worker, keep)

    def _send(self, worker: _Worker, job: Job, videos: list[OpenedVideo], parts: dict[str, bytes],
              caps: MediaCaps) -> tuple[str, str] | None:
        """Send the job, then each file's descriptor; the cause if the process is gone already."""
        try:
            worker.conn.send((_placeholders(job), [(v.name, v.container, v.size) for v in videos], parts, caps))
            for video in videos:
                send_handle(worker.conn, video.fd, worker.process.pid)
        except OSError:
            return self._death(worker)
        return None

    def _death(self, worker: _Worker) -> tuple[str, str]:
        worker.process.join(_JOIN_S)
        code = worker.process.exitcode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            why = " (the kernel's out-of-memory killer, or an operator)" if -code == signal.SIGKILL else ""
            return ("signal", f"was killed by {name}{why} while decoding it")
        return ("signal", f"exited (status {code}) while decoding it")

    def _take(self) -> _Worker:
        """An idle worker that is still alive, else a new one: a worker that died while idle (the
        kernel's out-of-memory killer, an operator) is replaced, never blamed on the next file."""
        dead = []
        try:
            with self._lock:
                if self._closed:
                    raise ProxyError("the media pool is closed")
                while self._idle:
                    worker = self._idle.pop()
                    if worker.usable():
                        return worker
                    dead.append(worker)
                if not self.started:
                    self._context.set_forkserver_preload(_PRELOAD)
                self.started += 1
        finally:
            for worker in dead:
                worker.close(kill=True)
        return _Worker(self._context, self.config)

    def _give_back(self, worker: _Worker, keep: bool) -> None:
        worker.tasks += 1
        if keep and worker.tasks < self.config.tasks_per_process and worker.usable():
            with self._lock:
                if not self._closed:
                    self._idle.append(worker)
                    return
        worker.close(kill=not keep)

    def close(self) -> None:
        """Stops the idle processes (busy ones are given back to a closed pool and stopped then)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()


def _placeholders(job: Job) -> Job:
    """The job with each opened file as a marker: its descriptor travels beside it (SCM_RIGHTS)."""
    def marked(source: dict[str, Any] | None) -> dict[str, Any] | None:
        if source is None or not isinstance(source.get("video_path"), OpenedVideo):
            return source
        return {**source, "video_path": "<descriptor>"}

    if isinstance(job, CurveJob):
        return replace(job, source=marked(job.source))
    return replace(job, main=marked(job.main), extra=marked(job.extra))


def _rebuilt(cls: type[ProxyError], message: str, state: dict[str, Any]) -> ProxyError:
    """The worker's ProxyError as raised there (class, message, field, details)."""
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err
