"""A checked video file (proxy/media/file.py) decoded from its descriptor, within the request's
budget: the container's frame count and duration are checked against the caps before the first
frame, and again as frames are found; each wanted frame is brought to its sent sizes as it is
decoded; decoding stops at the caps, at the last wanted frame of a second pass, or when the
caller is gone. Blocking CPU work: runs on the media executor."""

from __future__ import annotations

import math
from collections.abc import Callable

import cv2

from proxy.errors import InvalidRequest, MediaBudgetExceeded, MediaDecodeError
from proxy.media.budget import DecodeBudget
from proxy.media.decoded import DecodedSource
from proxy.media.file import OpenedVideo
from proxy.media.frame_plan import Episodes, Size, planned_bytes, target_sizes
from proxy.media.mp4_index import IndexTooLarge, claimed_samples

__all__ = ["read_video"]


class _Targets:
    """The episodes' sizes per source index, for a frame of a given shape (a stream whose frames
    differ from the container's stated size gets its own sizes; encode_prefix refuses mixed sizes)."""

    def __init__(self, limits, episodes: Episodes) -> None:
        self.limits, self.episodes = limits, episodes
        self._by_shape: dict[Size, dict[int, set[Size]]] = {}

    def of(self, height: int, width: int) -> dict[int, set[Size]]:
        if (height, width) not in self._by_shape:
            self._by_shape[(height, width)] = target_sizes(self.limits, self.episodes, height, width, "video_path")
        return self._by_shape[(height, width)]


def _open(video: OpenedVideo):
    # One FFmpeg decoder thread: the media executor's workers are the parallelism.
    capture = cv2.VideoCapture(video.decode_path, cv2.CAP_FFMPEG, [cv2.CAP_PROP_N_THREADS, 1])
    if not capture.isOpened():
        capture.release()
        raise MediaDecodeError(f"cannot open {video.name} as a video ({video.container})", field="video_path")
    return capture


def _check_index(video: OpenedVideo, budget: DecodeBudget) -> None:
    """An MP4/MOV's claimed samples, before FFmpeg opens it and builds an entry for each."""
    if video.container != "MP4/MOV":
        return
    try:
        samples = claimed_samples(video.fd, video.size)
    except IndexTooLarge as err:
        raise MediaBudgetExceeded(f"{video.name}: its index has {err}; refused before it is opened",
                                  field="video_path", limit="proxy.max_video_frames") from None
    budget.check_index(samples)


def read_video(video: OpenedVideo, limits, episodes_for: Callable[[int], Episodes],
               budget: DecodeBudget) -> DecodedSource:
    _check_index(video, budget)
    capture = _open(video)
    try:
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width * height > limits.max_source_pixels:
            raise MediaDecodeError(f"video frames are {width}x{height}, over the "
                                   f"{limits.max_source_pixels}-pixel cap", field="video_path")
        budget.expect_memory(width * height)
        fps = capture.get(cv2.CAP_PROP_FPS)
        fps = fps if fps and math.isfinite(fps) and fps > 0 else None
        reported = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        targets = None
        if reported > 0:
            budget.check_frames(reported, fps, found=False)
            episodes = _episodes_if_valid(episodes_for, reported)
            if episodes is not None:
                targets = _Targets(limits, episodes)
                planned = planned_bytes(targets.of(height, width), height, width)
                budget.check_plan(planned)  # before any decode
                budget.expect_memory(width * height, planned)
        source = DecodedSource(count=0, fps=fps or limits.default_source_fps, field="video_path")
        decoded = _decode(capture, source, targets, budget, fps, (height, width))
    finally:
        capture.release()
    if decoded == 0:
        raise MediaDecodeError(f"{video.name} has no decodable frames", field="video_path")
    source.count = decoded
    if decoded != reported or targets is None:
        # The container's count was wrong (common for truncated files): pick again over what exists.
        # Frames already kept at the right sizes are reused; else one more pass, bounded by the frame
        # cap the first pass enforced and stopped at the new plan's last frame.
        again = _Targets(limits, episodes_for(decoded))
        shape = next(iter(source.sizes.values()), (height, width))
        needed = again.of(*shape)
        planned = planned_bytes(needed, *shape)
        budget.check_plan(planned)
        budget.expect_memory(width * height, planned)
        if not source.drop_except(needed, budget):
            source.clear(budget)
            capture = _open(video)
            try:
                _decode(capture, source, again, budget, fps, shape, stop_after=max(needed, default=-1))
            finally:
                capture.release()
    return source


def _episodes_if_valid(episodes_for: Callable[[int], Episodes], reported: int) -> Episodes | None:
    """The plan over the container's frame count; None when that count cannot satisfy the request
    (a prefix past it): the decoded count, not the container's claim, decides that error."""
    try:
        return episodes_for(reported)
    except InvalidRequest:
        return None


def _decode(capture, into: DecodedSource, targets: _Targets | None, budget: DecodeBudget, fps: float | None,
            shape: Size, stop_after: int | None = None) -> int:
    """Decode in order, keeping wanted frames at their sent sizes; returns the frames found."""
    index = 0
    while stop_after is None or index <= stop_after:
        budget.checkpoint()  # the caller may be gone: stop between frames
        if not capture.grab():
            break
        budget.check_frames(index + 1, fps, found=True)
        sizes = targets.of(*shape).get(index) if targets is not None else None
        if sizes:
            budget.hold_source(shape[0] * shape[1] * 3)
            ok, bgr = capture.retrieve()
            if ok:
                if bgr.shape[:2] != shape:
                    budget.hold_source(bgr.shape[0] * bgr.shape[1] * 3)
                    sizes = targets.of(*bgr.shape[:2]).get(index, set())
                into.keep(index, bgr, sizes, budget, bgr=True)
        index += 1
    return index
