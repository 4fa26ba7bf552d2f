"""One request's media work as data: its sources, its frame plan and its limits, and the function
that does it. A job holds no callables, so it can be sent to a decoder process
(proxy/media/decoder_pool.py) as well as run on a media thread, with the same result.

The plan is data: an episode's `prefix_end` (or none) with `limits.nframes`, or a dense curve's
`prefix_ends` or `points`; the frame indices follow from those once the source's frame count is
known (`curve_ends`, `prefix_indices`). A video source is opened and checked in the proxy
(`opened_videos`, proxy/media/file.py) before the job runs anywhere: what runs receives the opened
descriptor, never a path to open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from proxy.errors import InvalidRequest, ProxyError
from proxy.media.budget import DecodeBudget
from proxy.media.decode import FrameLimits, decode_source
from proxy.media.encode import EncodedFrames, encode_prefix, prefix_indices, prepare_frames
from proxy.media.file import OpenedVideo, open_video
from proxy.media.request_parts import PARTS
from proxy.media.views import Placement, prepare_views
from vlm_protocol.frames import sample_indices
from vlm_protocol.multipart import PART_PREFIX

__all__ = ["Curve", "CurveJob", "EpisodeJob", "Job", "curve_ends", "job_parts", "opened_videos", "run_job"]

DEFAULT_POINTS = 8


@dataclass(frozen=True)
class EpisodeJob:
    """One episode's frames (/score, a batch item, a /compare or /progress episode): `main` and
    `extra` are decode_source's source keywords (video_path, media_roots, frames, frames_npy, fps, stills)."""

    limits: FrameLimits
    main: dict[str, Any]
    prefix_end: int | None = None
    placement: Placement | None = None  # a second camera's placement, with `extra`
    extra: dict[str, Any] | None = None


@dataclass(frozen=True)
class CurveJob:
    """Every prefix of a /score/dense curve from one decode: `prefix_ends` as given, or `points` spread."""

    limits: FrameLimits
    source: dict[str, Any]
    prefix_ends: list[int] | None = None
    points: int = DEFAULT_POINTS


@dataclass(frozen=True)
class Curve:
    count: int  # frames in the episode
    load_ms: float
    ends: list[int]  # each prefix's last frame
    frames: list[EncodedFrames] = field(default_factory=list)  # each prefix's, in the order of `ends`


Job = EpisodeJob | CurveJob


def curve_ends(prefix_ends: list[int] | None, points: int, count: int) -> list[int]:
    """The prefixes' last frames: `prefix_ends` as given (each within the episode), or `points`
    spread as frames are sampled (the first frame's prefix left out: it holds one frame, no progress)."""
    if prefix_ends is not None:
        if prefix_ends[-1] >= count:
            raise InvalidRequest(f"prefix_ends[-1] {prefix_ends[-1]} is past the episode's last frame "
                                 f"({count - 1})", field="prefix_ends")
        return list(prefix_ends)
    if count < 2:
        raise InvalidRequest(f"a dense curve needs at least 2 frames, the episode has {count}", field="points")
    ends = sample_indices(count, points + 1)[1:]  # the first end would be frame 0 alone
    if len(ends) < points:
        raise InvalidRequest(f"points {points} is more than the episode's {count - 1} prefixes after its first frame",
                             field="points")
    return ends


def run_job(job: Job, budget: DecodeBudget) -> EncodedFrames | Curve:
    """The job's JPEGs and their metadata (blocking CPU work: a media thread or a decoder process)."""
    if isinstance(job, CurveJob):
        ends: list[int] = []

        def episodes_for(count: int) -> list[list[int]]:
            ends[:] = curve_ends(job.prefix_ends, job.points, count)
            return [prefix_indices(count, job.limits.nframes, end) for end in ends]

        decoded = decode_source(job.limits, episodes_for, budget, **job.source)
        return Curve(decoded.count, decoded.load_ms, list(ends),
                     [encode_prefix(job.limits, decoded, end) for end in ends])
    if job.placement is not None:
        assert job.extra is not None
        return prepare_views(job.limits, budget, job.placement, prefix_end=job.prefix_end, main=job.main,
                             extra=job.extra)
    return prepare_frames(job.limits, budget, prefix_end=job.prefix_end, **job.main)


@contextlib.contextmanager
def opened_videos(job: Job) -> Iterator[tuple[Job, list[OpenedVideo]]]:
    """The job with each `video_path` opened and checked (blocking: a media thread), and the opened
    files, closed on exit. A second camera's refusal names `extra_view`."""
    with contextlib.ExitStack() as stack:
        videos: list[OpenedVideo] = []

        def opened(source: dict[str, Any] | None, where: str | None) -> dict[str, Any] | None:
            path = source.get("video_path") if source else None
            if source is None or path is None or isinstance(path, OpenedVideo):
                return source
            try:
                video = stack.enter_context(open_video(str(path), list(source.get("media_roots") or ())))
            except ProxyError as err:
                if where is not None:
                    err.within(where)
                raise
            videos.append(video)
            return {**source, "video_path": video}

        if isinstance(job, CurveJob):
            job = replace(job, source=opened(job.source, None))
        else:
            job = replace(job, main=opened(job.main, None), extra=opened(job.extra, "extra_view"))
        yield job, videos


def job_parts(job: Job) -> dict[str, bytes]:
    """The raw parts of this request's binary body that the job's fields name ("part:<name>"), for a
    process that does not share the request's context."""
    sources = [job.source] if isinstance(job, CurveJob) else [job.main, job.extra]
    named = {value[len(PART_PREFIX):] for source in sources if source
             for key in ("frames", "frames_npy", "stills")
             for value in ([source.get(key)] if isinstance(source.get(key), str) else source.get(key) or ())
             if isinstance(value, str) and value.startswith(PART_PREFIX)}
    parts = PARTS.get() or {}
    return {name: parts[name] for name in named if name in parts}
