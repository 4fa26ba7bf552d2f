"""Two cameras of one episode (a backend's frames.extra_view): both decoded at the same source
indices, within the one request budget, then placed as the backend declares.

    second_video  the second view is its own video at the main view's budget: twice the vision tokens.
    side_by_side  each frame is [main | second]: each view sized at half the per-frame (and total)
                  pixel budget, so the pair costs about what one view does.

The second view is taken at the main view's indices, so both must hold the same number of frames
(a wrist camera recorded with the agent view): any other count is refused, never resampled.
Blocking CPU work, run on the media executor like `prepare_frames`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import numpy as np

from proxy.errors import InvalidRequest, MediaDecodeError, ProxyError
from proxy.media.budget import DecodeBudget
from proxy.media.decode import FrameLimits, decode_source
from proxy.media.decoded import DecodedSource
from proxy.media.encode import EncodedFrames, decodable_indices, encode_jpeg, encode_prefix, prefix_indices
from proxy.media.frame_plan import Size, episode_sizes, resize_frame
from vlm_protocol.frames import PATCH_FACTOR, vision_tokens

__all__ = ["Placement", "check_views", "extra_view_info", "half_budget", "prepare_views"]

Placement = Literal["second_video", "side_by_side"]


def check_views(placement: Placement | None, *, given: bool, frame_rules: bool) -> Placement | None:
    """The backend's placement of a second camera, when the request (`given`: it holds extra_view)
    agrees: a second view is never dropped, and never missing where the backend's prompt expects it."""
    if placement is None and given:
        raise InvalidRequest("this backend takes one camera (its frames.extra_view is not set): a request with "
                             "extra_view is refused rather than scored without it", field="extra_view")
    if placement is not None and not given:
        raise InvalidRequest(f"this backend places a second camera (frames.extra_view: {placement}): send "
                             "extra_view (the wrist view) with the episode, on /score, /score/batch or "
                             "/progress/batch (the routes that take one)", field="extra_view")
    if placement == "side_by_side" and frame_rules:
        raise InvalidRequest("frames sent with frame_rules are forwarded as they are, but side_by_side composes "
                             "the two views into each frame: send raw frames", field="frame_rules")
    return placement


def extra_view_info(placement: Placement, frames: EncodedFrames) -> dict[str, Any]:
    """What FramesInfo.extra_view records of the second camera."""
    info = {"placement": placement, "source_count": frames.extra_count or 0}
    if frames.extra is not None:  # second_video
        extra = frames.extra
        return {**info, "size": (extra.width, extra.height), "sha256": extra.sha256,
                "vision_tokens": vision_tokens(extra.height, extra.width, len(extra.jpegs), video=True)}
    main, other = frames.views or ((frames.width, frames.height), (0, 0))
    return {**info, "size": other, "main_size": main}


def half_budget(limits: FrameLimits) -> FrameLimits:
    """Each view's share of a side-by-side frame: half of every pixel budget and floor."""
    return replace(limits, max_pixels=limits.max_pixels // 2, min_pixels=limits.min_pixels // 2,
                   video_max_pixels=limits.video_max_pixels // 2, total_pixels=limits.total_pixels // 2,
                   image_min_pixels=limits.image_min_pixels // 2)


def prepare_views(limits: FrameLimits, budget: DecodeBudget, placement: Placement, *, prefix_end: int | None,
                  main: dict[str, Any], extra: dict[str, Any]) -> EncodedFrames:
    """The episode's frames as sent with its second view (`main`, `extra`: decode_source's sources)."""
    started = time.perf_counter()
    side = placement == "side_by_side"
    per_view = half_budget(limits) if side else limits

    def episodes_for(count: int) -> list[list[int]]:
        return [prefix_indices(count, limits.nframes, prefix_end)]

    first = decode_source(per_view, episodes_for, budget, **main)
    budget.earlier_sources = budget.kept_bytes  # the second view's plan is checked beside these
    # side_by_side: the stills are composed too (PRIMO-R1's first and last frame show both views)
    second = _as_extra_view(lambda: decode_source(per_view if side else replace(per_view, stills=False),
                                                  _same_count(first.count, episodes_for), budget, **extra,
                                                  field_prefix="extra_view."))
    # A frame either view lost is left out of both (as one camera leaves out a frame that would not decode).
    indices = decodable_indices(prefix_indices(first.count, limits.nframes, prefix_end), first, second)
    if not side:
        video = encode_prefix(limits, first, prefix_end, indices=indices)
        other = _as_extra_view(lambda: encode_prefix(replace(limits, stills=False), second, prefix_end,
                                                     indices=indices))
        return replace(video, extra=other, extra_count=second.count, load_ms=first.load_ms + second.load_ms,
                       encode_ms=(time.perf_counter() - started) * 1e3 - first.load_ms - second.load_ms)
    return _side_by_side(limits, per_view, first, second, indices, prefix_end, started)


def _same_count(count: int, episodes_for: Callable[[int], list[list[int]]]) -> Callable[[int], list[list[int]]]:
    def extra_episodes(extra_count: int) -> list[list[int]]:
        if extra_count != count:
            raise MediaDecodeError(f"extra_view holds {extra_count} frames and the main view {count}: the two "
                                   "cameras of one episode are taken at the same indices", field="extra_view")
        return episodes_for(extra_count)
    return extra_episodes


def _side_by_side(limits: FrameLimits, per_view: FrameLimits, first: DecodedSource, second: DecodedSource,
                  indices: list[int], prefix_end: int | None, started: float) -> EncodedFrames:
    """[main | second] in every frame (and still): each view at its half-budget size, the second
    brought to the main view's height (its width kept a multiple of the patch, its aspect kept)."""
    def sizes_of(view: DecodedSource) -> tuple[Size, Size | None]:
        shape = view.sizes[indices[0]]
        if any(view.sizes[i] != shape for i in indices):
            raise MediaDecodeError("frames of one view must all have the same size", field=view.field)
        return episode_sizes(per_view, *shape, len(indices), view.field)

    (main_video, main_still), (other_video, other_still) = sizes_of(first), _as_extra_view(lambda: sizes_of(second))

    def beside(size: Size, other: Size) -> Size:
        """The second view's size beside a part of `size`: the same height, its own aspect. Never more
        pixels than its own half of the budget gave it: views of other shapes (a tall one beside a wide
        one) would make a frame many times the budget, so they are refused, never stretched."""
        width = max(PATCH_FACTOR, round(other[1] * size[0] / other[0] / PATCH_FACTOR) * PATCH_FACTOR)
        if size[0] * width > other[0] * other[1] + size[0] * PATCH_FACTOR:  # one patch column of rounding
            raise MediaDecodeError(f"side_by_side: the second view ({other[1]}x{other[0]} as sized) beside the "
                                   f"main view's height {size[0]} would take {width} columns, more pixels than its "
                                   "half of the budget: the two views need about one aspect ratio",
                                   field="extra_view")
        return size[0], width

    def pair(index: int, size: Size, other: Size) -> bytes:
        right = _resized(second.frame_at(index, other), beside(size, other))
        return encode_jpeg(np.ascontiguousarray(np.hstack([first.frame_at(index, size), right])), limits.jpeg_quality)

    jpegs = [pair(i, main_video, other_video) for i in indices]
    stills = ([pair(i, main_still, other_still) for i in (indices[0], indices[-1])]
              if main_still is not None and other_still is not None else [])
    width = main_video[1] + beside(main_video, other_video)[1]
    return EncodedFrames(
        jpegs=jpegs, indices=indices, source_count=first.count, width=width, height=main_video[0],
        sampled_fps=first.fps * len(indices) / (prefix_end + 1 if prefix_end is not None else first.count),
        load_ms=first.load_ms + second.load_ms,
        encode_ms=(time.perf_counter() - started) * 1e3 - first.load_ms - second.load_ms, stills=stills,
        still_size=(main_still[1] + beside(main_still, other_still)[1], main_still[0]) if stills else None,
        views=((main_video[1], main_video[0]), beside(main_video, other_video)[::-1]), extra_count=second.count)


def _resized(frame: np.ndarray, size: Size) -> np.ndarray:
    return frame if frame.shape[:2] == size else resize_frame(frame, *size)


def _as_extra_view(call: Callable[[], Any]) -> Any:
    """Errors of the second view name it (`extra_view.frames`, ...), so the caller knows which camera."""
    try:
        return call()
    except ProxyError as err:
        err.within("extra_view")  # renamed in place: the traceback and cause stay
        raise
