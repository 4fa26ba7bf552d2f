"""What one request's media work may hold, and where that work runs.

`DecodeBudget`: the decoded bytes a request holds at once — one source frame in flight plus every
frame kept at the size it is sent — against `proxy.max_decoded_mb`; the video caps
(`max_video_frames`, `max_video_seconds`); and the request's cancellation, checked between frames.
`MediaExecutor`: the app's bounded pool of media threads (`proxy.media_workers`), OpenCV's own
thread pool off in them. Threads, not processes: OpenCV releases the GIL in its decode, resize and
encode calls, so an episode holds the GIL for under a sixth of its CPU and W threads scale ~W-fold,
where a process would first have to copy the request's frames (docs/benchmarks.md §9). Decoded
frames live only inside one of its calls (what leaves is JPEG bytes), so the proxy's decoded memory
is at most media_workers x max_decoded_mb.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import cv2

from proxy.errors import MediaBudgetExceeded

__all__ = ["DecodeBudget", "DecodeCancelled", "MediaCaps", "MediaExecutor", "cgroup_cpu_quota",
           "default_media_workers", "usable_cores"]

T = TypeVar("T")
MIB = 2**20
# Index samples an MP4/MOV may claim per allowed video frame (all its tracks: audio has more
# samples per second than video; FFmpeg keeps ~40 bytes per sample while it opens the file).
INDEX_SAMPLES_PER_FRAME = 16


class DecodeCancelled(Exception):
    """The request's caller is gone (its task was cancelled): the decode stops at the next frame."""


@dataclass(frozen=True)
class MediaCaps:
    max_decoded_bytes: int
    max_video_frames: int
    max_video_seconds: float


@dataclass
class DecodeBudget:
    """One request's decoded bytes. Used by one media thread at a time (no lock needed)."""

    caps: MediaCaps
    field: str = "video_path"  # the request field the frames come from, for errors
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    source_bytes: int = 0  # the largest source frame in flight (one at a time)
    kept_bytes: int = 0  # frames kept at a sent size
    peak_bytes: int = 0
    earlier_sources: int = 0  # bytes kept by the request's earlier source (proxy/media/views.py sets it)

    @classmethod
    def unbounded(cls) -> DecodeBudget:
        """For benches and tools that decode outside a request."""
        return cls(MediaCaps(max_decoded_bytes=2**62, max_video_frames=2**62, max_video_seconds=float("inf")))

    def check_plan(self, needed_bytes: int) -> None:
        """Refuse up front what would not fit (before the first frame is decoded), beside what the
        request's earlier source keeps (a second camera's plan beside the first's frames)."""
        if needed_bytes + self.earlier_sources > self.caps.max_decoded_bytes:
            raise self._over(needed_bytes + self.earlier_sources)

    def hold_source(self, nbytes: int) -> None:
        """A source frame about to be decoded (one at a time: the largest counts)."""
        self.checkpoint()
        if nbytes > self.source_bytes:
            self.source_bytes = nbytes
            self._check()

    def keep(self, nbytes: int) -> None:
        self.kept_bytes += nbytes
        self._check()

    def release(self, nbytes: int) -> None:
        self.kept_bytes -= nbytes

    def checkpoint(self) -> None:
        if self.cancelled.is_set():
            raise DecodeCancelled

    def check_frames(self, count: int, fps: float | None, *, found: bool) -> None:
        """A video of `count` frames (a container's claim, or `found` while decoding) within the caps."""
        how = "has at least" if found else "claims"
        if count > self.caps.max_video_frames:
            raise MediaBudgetExceeded(f"the video {how} {count} frames, over proxy.max_video_frames "
                                      f"({self.caps.max_video_frames})", field=self.field,
                                      limit="proxy.max_video_frames", needed=count)
        if fps and count / fps > self.caps.max_video_seconds:
            seconds = round(count / fps, 3)
            raise MediaBudgetExceeded(f"the video {how} {seconds} s ({count} frames at {fps:g} fps), over "
                                      f"proxy.max_video_seconds ({self.caps.max_video_seconds:g})",
                                      field=self.field, limit="proxy.max_video_seconds", needed=seconds)

    def check_index(self, samples: int) -> None:
        """An MP4/MOV index's claimed samples (proxy/media/mp4_index.py), before FFmpeg builds it:
        INDEX_SAMPLES_PER_FRAME x max_video_frames leaves room for audio tracks' samples."""
        limit = INDEX_SAMPLES_PER_FRAME * self.caps.max_video_frames
        if samples > limit:
            raise MediaBudgetExceeded(f"the video's index claims {samples} samples, over {INDEX_SAMPLES_PER_FRAME} x "
                                      f"proxy.max_video_frames ({limit}); refused before it is opened",
                                      field=self.field, limit="proxy.max_video_frames", needed=samples)

    def _check(self) -> None:
        total = self.source_bytes + self.kept_bytes
        self.peak_bytes = max(self.peak_bytes, total)
        if total > self.caps.max_decoded_bytes:
            raise self._over(total)

    def _over(self, needed_bytes: int) -> MediaBudgetExceeded:
        budget_mb, needed_mb = self.caps.max_decoded_bytes / MIB, needed_bytes / MIB
        return MediaBudgetExceeded(
            f"{self.field}: the request needs {needed_mb:.1f} MiB of decoded frames (a source frame plus every "
            f"frame at the size sent), over proxy.max_decoded_mb ({budget_mb:g} MiB); send fewer or smaller "
            "frames (nframes, max_pixels, fewer points)", field=self.field, limit="proxy.max_decoded_mb",
            needed=round(needed_mb, 1))


def default_media_workers() -> int:
    """`proxy.media_workers` when unset: the cores this process may use, at most 8."""
    return min(8, usable_cores())


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a cpuset), within its cgroup's
    CPU quota (a container's --cpus), rounded up. os.cpu_count() counts the machine's, which
    oversubscribes a pinned or throttled proxy."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity API (not Linux)
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota, in CPUs, on this process's cgroup and its parents: cgroup v2's
    `cpu.max` ("<quota> <period>", or "max" for none) or v1's `cpu.cfs_quota_us` (-1 for none) over
    `cpu.cfs_period_us`; None where there is none, or no cgroup to read."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and path:  # v2: one hierarchy, the controllers' files in every cgroup
            mount, read = root, _v2_quota
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own mount
            mount, read = root / controllers, _v1_quota
        else:
            continue
        folder = mount / path.strip().lstrip("/")
        for parent in (folder, *folder.parents):
            if parent != mount and not parent.is_relative_to(mount):
                break
            with contextlib.suppress(OSError, ValueError, ZeroDivisionError):
                if (quota := read(parent)) is not None:
                    quotas.append(quota)
    return min(quotas, default=None)


def _v2_quota(folder: Path) -> float | None:
    quota, period = folder.joinpath("cpu.max").read_text().split()[:2]
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: Path) -> float | None:
    quota = int(folder.joinpath("cpu.cfs_quota_us").read_text())
    return None if quota < 0 else quota / int(folder.joinpath("cpu.cfs_period_us").read_text())


def _one_opencv_thread() -> None:
    cv2.setNumThreads(1)  # parallelism is the pool's: workers x OpenCV threads would oversubscribe


class MediaExecutor:
    """The app's media threads. `run(fn)` calls `fn(budget)` on one of them; when the awaiting task
    is cancelled (caller gone, deadline) the budget's flag is set and the decode stops between frames."""

    def __init__(self, workers: int, caps: MediaCaps) -> None:
        self.caps = caps
        self.workers = workers
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="media",
                                                           initializer=_one_opencv_thread)

    async def run(self, fn: Callable[[DecodeBudget], T]) -> T:
        budget = DecodeBudget(self.caps)
        # The caller's context goes along (as asyncio.to_thread does): a binary body's parts live in it.
        context = contextvars.copy_context()
        future = asyncio.get_running_loop().run_in_executor(self._pool, context.run, fn, budget)
        try:
            return await future
        except asyncio.CancelledError:
            budget.cancelled.set()
            raise

    def close(self) -> None:
        """Waits for running decodes (each stops at its next frame once cancelled)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
