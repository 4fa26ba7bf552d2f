"""The loop of one video-decoder process (proxy/media/decoder_pool.py starts and supervises it):
receive a job (proxy/media/decode_jobs.py) with its opened files' descriptors, run it, send back
its JPEGs and their metadata, or the error it raised — never decoded frames.

Invariants, per job: the process's address space may grow by at most what the job's stated frame
size and plan need (`DecodeBudget.expect_memory`, plus `OPEN_BYTES` for FFmpeg's demuxer and the
encoder), never past `max_memory_mb`; an allocation past that fails in here (ENOMEM, never the
kernel's OOM killer), and the job is answered "memory". FFmpeg reports a failed allocation only
in its log (through OpenCV, a frame that will not decode looks like the end of the stream), so
the process's stderr is a memory file that each job reads back. One OpenCV and FFmpeg thread.
No core files: a crashing decoder would write hundreds of MB per crash.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import signal
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import cv2

from proxy.errors import ProxyError
from proxy.media.budget import DecodeBudget, MediaCaps
from proxy.media.decode_jobs import CurveJob, Job, run_job
from proxy.media.file import OpenedVideo
from proxy.media.request_parts import PARTS

__all__ = ["CRASH_HOOK_ENV", "OPEN_BYTES", "WorkerLimits", "serve"]

MIB = 2**20
# Address space a job may use beyond its frames: FFmpeg's demuxer and index while it opens the file,
# the JPEG encoder, the job's own Python objects. A 12000x12000 frame (216 MiB of YUV) does not fit.
OPEN_BYTES = 128 * MIB
# Test-only: a FIFO path. A decoder process whose environment names one kills itself with SIGSEGV
# after the first frame of a file whose name starts with "segv", as a decoder's memory bug would;
# with one whose name starts with "crash", it first reads that FIFO (it waits there until the test
# has opened and closed its other end).
CRASH_HOOK_ENV = "VLM_PROXY_TEST_DECODER_SIGSEGV_FIFO"
# What FFmpeg and OpenCV say when an allocation fails (libavutil's ENOMEM text, its frame pools',
# and OpenCV's OutOfMemoryError).
_ALLOCATION_FAILED = (b"get_buffer() failed", b"Cannot allocate memory", b"Insufficient memory",
                      b"Out of memory")


@dataclass(frozen=True)
class WorkerLimits:
    max_memory_bytes: int


def serve(conn: Connection, limits: WorkerLimits) -> None:
    """The process's main function: jobs until the pool closes its end of the pipe."""
    cv2.setNumThreads(1)  # the pool's processes are the parallelism
    _keep_freed_heap()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops the proxy, which stops this
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    log = os.memfd_create("ffmpeg-log")
    os.dup2(log, 2)
    start = _address_space()
    hard = start + 2 * limits.max_memory_bytes  # a backstop: each job's own limit is lower
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    crash_fifo = os.environ.get(CRASH_HOOK_ENV)
    while True:
        try:
            job, videos, parts, caps = conn.recv()
            fds = [recv_handle(conn) for _ in videos]
        except (EOFError, OSError):
            return
        opened = [OpenedVideo(fd, *about) for fd, about in zip(fds, videos, strict=True)]
        try:
            reply = _run(job, opened, parts, caps, limits, hard, crash_fifo, log)
        finally:
            for video in opened:
                video.close()
        conn.send(reply)


def _run(job: Job, videos: list[OpenedVideo], parts: dict[str, bytes], caps: MediaCaps, limits: WorkerLimits,
         hard: int, crash_fifo: str | None, log: int) -> tuple[str, Any]:
    os.ftruncate(log, 0)
    os.lseek(log, 0, os.SEEK_SET)
    base = _address_space()

    def limit_to(extra: int) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (min(hard, base + OPEN_BYTES + min(extra, limits.max_memory_bytes)),
                                                hard))

    budget = DecodeBudget(caps, memory_guard=limit_to)
    if crash_fifo and any(video.name.startswith(("crash", "segv")) for video in videos):
        wait = any(video.name.startswith("crash") for video in videos)
        budget.on_checkpoint = _crash_after_first_frame(crash_fifo if wait else None)
    PARTS.set(parts)
    limit_to(0)
    try:
        outcome: tuple[str, Any] = ("ok", run_job(_with_videos(job, videos), budget))
    except ProxyError as err:
        outcome = ("error", (type(err), err.message, dict(vars(err))))
    except MemoryError:
        outcome = ("memory", "an allocation failed")
    except Exception as err:  # noqa: BLE001 - a bug, or OpenCV's own allocation failure: told apart below
        outcome = ("bug", "".join(traceback.format_exception(err)))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    failed = _first_line_with(os.pread(log, 1 << 16, 0), _ALLOCATION_FAILED)
    if failed is None and outcome[0] == "bug" and "Insufficient memory" in outcome[1]:
        failed = "OpenCV: insufficient memory"
    if failed is not None:
        return ("memory", failed)
    return outcome


def _with_videos(job: Job, videos: list[OpenedVideo]) -> Job:
    """The job with its `video_path` fields (placeholders from the pool) as the received descriptors,
    in the order the pool sent them (main, then extra; or the curve's one source)."""
    queue = list(videos)

    def filled(source: dict[str, Any] | None) -> dict[str, Any] | None:
        if source is None or source.get("video_path") is None:
            return source
        return {**source, "video_path": queue.pop(0)}

    if isinstance(job, CurveJob):
        return replace(job, source=filled(job.source))
    return replace(job, main=filled(job.main), extra=filled(job.extra))


def _first_line_with(text: bytes, needles: tuple[bytes, ...]) -> str | None:
    for line in text.splitlines():
        if any(needle in line for needle in needles):
            return line.decode(errors="replace").strip()[:300]
    return None


def _crash_after_first_frame(fifo: str | None):
    calls = 0

    def maybe_crash() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # the first frame has been decoded: this is the middle of the decode
            if fifo is not None:  # waits until the test opens the FIFO's other end and closes it again
                held = os.open(fifo, os.O_RDONLY)
                os.read(held, 1)
                os.close(held)
            os.kill(os.getpid(), signal.SIGSEGV)

    return maybe_crash


def _keep_freed_heap() -> None:
    """glibc's malloc in a young process hands freed frames back to the kernel and faults them in
    again on the next decode: ~3 ms of a 13 ms episode here (docs/benchmarks.md §11). Keep up to 64 MiB
    of freed heap, and serve allocations under 32 MiB from it; a decoded frame larger than that is
    mapped on its own, so the address-space limit still meets every large one."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "mallopt"):  # glibc: M_TRIM_THRESHOLD -1, M_MMAP_THRESHOLD -3
        libc.mallopt(-1, 64 * MIB)
        libc.mallopt(-3, 32 * MIB)


def _address_space() -> int:
    """The process's address space now (VmSize), in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
