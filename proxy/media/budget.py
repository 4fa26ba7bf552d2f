"""What one request's media work may hold, and on how many cores it runs.

`DecodeBudget`: the decoded bytes a request holds at once — one source frame in flight plus every
frame kept at the size it is sent — against `proxy.max_decoded_mb`; the video caps
(`max_video_frames`, `max_video_seconds`); the request's cancellation, checked between frames; and,
in a decoder process, the memory the decode may take (`expect_memory`). `usable_cores`: the
default count of media threads (proxy/media/executor.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from proxy.errors import MediaBudgetExceeded

__all__ = ["DECODER_FRAMES", "DecodeBudget", "DecodeCancelled", "MediaCaps", "cgroup_cpu_quota",
           "default_media_workers", "usable_cores"]

MIB = 2**20
# Index samples an MP4/MOV may claim per allowed video frame (all its tracks: audio has more
# samples per second than video; FFmpeg keeps ~40 bytes per sample while it opens the file).
INDEX_SAMPLES_PER_FRAME = 16
# Frames of its stated size a video decoder may hold at once (its reference and output frames, and
# OpenCV's converted copy): what a decoder process may add for the frames, beside the kept ones.
DECODER_FRAMES = 8


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
    # In a decoder process: told what this decode may need beyond what the process held when it began
    # (proxy/media/decoder_process.py lowers its address-space limit to that). None on a media thread.
    memory_guard: Callable[[int], None] | None = None
    on_checkpoint: Callable[[], None] | None = None  # a test hook in a decoder process; None otherwise
    _on_cancel: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    _cancel_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

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
        if self.on_checkpoint is not None:
            self.on_checkpoint()
        if self.cancelled.is_set():
            raise DecodeCancelled

    def cancel(self) -> None:
        """The caller is gone: the flag for a decode on this thread, the callbacks for one elsewhere."""
        with self._cancel_lock:
            self.cancelled.set()
            callbacks, self._on_cancel = self._on_cancel, []
        for callback in callbacks:
            callback()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the request is cancelled (now, if it is already); returns its remover."""
        with self._cancel_lock:
            if not self.cancelled.is_set():
                self._on_cancel.append(callback)
                return lambda: self._forget(callback)
        callback()
        return lambda: None

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._cancel_lock, contextlib.suppress(ValueError):
            self._on_cancel.remove(callback)

    def expect_memory(self, frame_pixels: int, planned_bytes: int = 0) -> None:
        """A decode of frames of `frame_pixels` (the container's stated size) that keeps `planned_bytes`:
        in a decoder process, that and the decoder's own frames are all it may allocate."""
        if self.memory_guard is not None:
            self.memory_guard(DECODER_FRAMES * 3 * frame_pixels + planned_bytes + self.earlier_sources)

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
