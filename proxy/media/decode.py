"""Where an episode's frames come from: a video file under an allowed root, base64 images, or a
base64 .npy array — decoded once, only at the indices wanted, each brought to the sizes it is sent
at as it is decoded (proxy/media/frame_plan.py), within the request's budget (proxy/media/budget.py).

`decode_source` takes an `episodes_for(frame count) -> episodes` rule instead of a frame count, so
one pass serves one sampled episode (/score) and every prefix of a curve (/score/dense).
Blocking CPU and file work: callers run it on the media executor.
"""

from __future__ import annotations

import binascii
import io
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pybase64  # SIMD base64, the decoder vLLM uses: 3.2 MB in 0.14 ms vs 6.5 ms

from proxy.errors import InvalidRequest, MediaDecodeError, MediaFormatRefused
from proxy.media.budget import DecodeBudget
from proxy.media.decoded import DecodedSource, decode_rgb
from proxy.media.file import OpenedVideo, describe_bytes, open_video, sniff_image
from proxy.media.frame_plan import Episodes, Size, resize_frame, target_sizes
from proxy.media.jpeg_header import plain_jpeg_size
from proxy.media.npy import NpyError, read_uint8
from proxy.media.request_parts import part_bytes
from proxy.media.video import read_video
from vlm_protocol import frame_codec
from vlm_protocol.frames import image_size
from vlm_protocol.multipart import PART_PREFIX

__all__ = ["DecodedSource", "FrameLimits", "decode_source", "prefix_count"]

SOURCE_FIELDS = ("video_path", "frames", "frames_npy")
_EXIF_ORIENTATION = 0x0112  # 1 = as stored; anything else, OpenCV rotates on decoding


@dataclass(frozen=True)
class FrameLimits:
    nframes: int
    max_pixels: int  # per frame, qwen-vl-utils' meaning (see vlm_protocol.frames)
    min_pixels: int  # the video floor
    video_max_pixels: int
    total_pixels: int
    image_min_pixels: int
    stills: bool  # also encode the first and last frame as still images (PRIMO-R1's layout)
    jpeg_quality: int
    default_source_fps: float
    max_inline_frames: int
    max_source_pixels: int


def prefix_count(count: int, prefix_end: int | None) -> int:
    """Frames an episode has when it is cut after source frame `prefix_end` (None: all)."""
    if prefix_end is None:
        return count
    if prefix_end >= count:
        raise InvalidRequest(f"prefix_end {prefix_end} is past the episode's last frame ({count - 1})",
                             field="prefix_end")
    return prefix_end + 1


def decode_source(limits: FrameLimits, episodes_for: Callable[[int], Episodes], budget: DecodeBudget, *,
                  video_path: str | Path | OpenedVideo | None = None, media_roots: Sequence[Path] = (),
                  frames: list[str] | None = None, frames_npy: str | None = None,
                  fps: float | None = None, stills: list[str] | None = None, field_prefix: str = "") -> DecodedSource:
    """Decode the frames `episodes_for(count)` names, from the one source given (a video_path is
    opened and checked here: proxy/media/file.py). `stills`: the caller's own first and last still
    images (with `frames`), instead of stills made from the first and last frame. `field_prefix`
    names the request object the source is in (`extra_view.`) in the budget's and the source's
    errors, raised during this call or later (frame_at). A `video_path` already opened
    (proxy/media/decode_jobs.py: opened_videos) is read as it is and left open."""
    started = time.perf_counter()
    source_fps = fps or limits.default_source_fps
    if stills is not None:
        limits = replace(limits, stills=False)  # the frames are planned at the video size only
    if video_path is not None:
        budget.field = f"{field_prefix}video_path"
        if isinstance(video_path, OpenedVideo):
            source = read_video(video_path, limits, episodes_for, budget)
        else:
            with open_video(str(video_path), list(media_roots)) as video:
                source = read_video(video, limits, episodes_for, budget)
    elif frames is not None:
        _check_inline_count(len(frames), "frames", limits)
        budget.field = f"{field_prefix}frames"
        source = DecodedSource(len(frames), source_fps, "frames")
        sizes_of = _sizes_by_shape(limits, episodes_for(len(frames)), "frames")
        for i in sorted({i for episode in sizes_of.episodes for i in episode}):  # only the kept ones
            _read_image(frames[i], i, limits, source, sizes_of, budget)
    elif frames_npy is not None:
        budget.field = f"{field_prefix}frames_npy"
        array = _load_npy(frames_npy, limits)
        _check_inline_count(array.shape[0], "frames_npy", limits)
        source = DecodedSource(array.shape[0], source_fps, "frames_npy")
        for i in {i for episode in episodes_for(array.shape[0]) for i in episode}:
            # Views of the request body (already bounded by proxy.max_body_mb): resized when encoded.
            source.source_frames[i], source.sizes[i] = array[i], array.shape[1:3]
    else:
        raise InvalidRequest("no frame source given", field="video_path")
    if stills is not None:
        source.stills = [_read_still(data, k, limits, budget) for k, data in enumerate(stills)]
        if len({size for _, size, _ in source.stills}) != 1:
            raise MediaDecodeError("the two stills must have the same size", field="stills")
    source.field = f"{field_prefix}{source.field}"
    source.load_ms = (time.perf_counter() - started) * 1e3
    return source


class _sizes_by_shape:  # noqa: N801 - a memo used like a function
    """The sizes each index is sent at, for images of a given shape (images may differ in size)."""

    def __init__(self, limits: FrameLimits, episodes: Episodes, field: str) -> None:
        self.limits, self.episodes, self.field = limits, episodes, field
        self._memo: dict[Size, dict[int, set[Size]]] = {}

    def __call__(self, index: int, shape: Size) -> set[Size]:
        if shape not in self._memo:
            self._memo[shape] = target_sizes(self.limits, self.episodes, *shape, self.field)
        return self._memo[shape].get(index, set())


def _b64decode(data: str, field: str) -> bytes:
    if data.startswith(PART_PREFIX):  # a raw part of a binary (multipart) body: no base64 at all
        return part_bytes(data, field)
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise MediaDecodeError(f"{field} is not valid base64", field=field) from err


def _probe_image(raw: bytes, field: str, limits: FrameLimits) -> tuple[int, int, bool]:
    """(height, width, forwardable) of an inline image, from its header: only JPEG and PNG are read,
    and the header first, so a decompression bomb is refused before decoding. Forwardable: an RGB,
    upright, complete JPEG, which vLLM decodes to the pixels the proxy would (sent as it came)."""
    if sniff_image(raw[:16]) is None:
        detected = describe_bytes(raw[:64])
        raise MediaFormatRefused(f"{field} is not a PNG/JPEG image: its content is {detected}", field=field,
                                 detected=detected)
    plain = plain_jpeg_size(raw)  # RGB, upright by construction: PIL's answer, from the markers alone
    if plain is not None:
        (height, width), forwardable = plain, True
    else:
        try:
            from PIL import Image

            with Image.open(io.BytesIO(raw), formats=["JPEG", "PNG"]) as probe:
                (width, height) = probe.size
                forwardable = probe.format == "JPEG" and probe.mode == "RGB" and _upright(probe)
        except Exception as err:  # noqa: BLE001 - any PIL failure means "not an image we can read"
            raise MediaDecodeError(f"{field} is not a PNG/JPEG image", field=field) from err
    if width * height > limits.max_source_pixels:
        raise MediaDecodeError(f"{field} is {width}x{height}, over the "
                               f"{limits.max_source_pixels}-pixel cap", field=field)
    # A cut JPEG (no end-of-image marker) is decoded here and fails as this request's own error;
    # other damage inside one surfaces as vLLM's 400, a rejected request (tests/real_vllm).
    return height, width, forwardable and raw.rstrip(b"\x00").endswith(b"\xff\xd9")


def _read_image(data: str, position: int, limits: FrameLimits, into: DecodedSource,
                sizes_of: _sizes_by_shape, budget: DecodeBudget) -> None:
    """One inline image into `into` at the sizes it is sent: an RGB JPEG already at a sent size is
    kept as its bytes (forwarded as it came); other sizes are made from one decode, now."""
    field = f"frames[{position}]"
    raw = _b64decode(data, field)
    height, width, forwardable = _probe_image(raw, field, limits)
    wanted = sizes_of(position, (height, width))
    if forwardable:
        into.sizes[position] = (height, width)  # forwardable: vLLM decodes these bytes to these pixels
        into.jpegs[(position, height, width)] = raw
        into.forwarded.add((position, height, width))
        if wanted <= {(height, width)}:
            return
    budget.hold_source(2 * 3 * width * height)  # the BGR decode and its RGB copy
    frame = decode_rgb(raw, position)  # OpenCV applies an EXIF rotation: its shape is the truth
    into.keep(position, frame, sizes_of(position, frame.shape[:2]), budget)


def _read_still(data: str, position: int, limits: FrameLimits, budget: DecodeBudget) -> tuple[bytes, Size, bool]:
    """One of the caller's stills as (JPEG, size, forwarded): forwarded when it is already at the image
    rule's size, else decoded and brought to it (the proxy never sends a size the rule would not make)."""
    field = f"stills[{position}]"
    raw = _b64decode(data, field)
    height, width, forwardable = _probe_image(raw, field, limits)
    try:
        size = image_size(height, width, max_pixels=limits.max_pixels, min_pixels=limits.image_min_pixels)
    except ValueError as err:
        raise MediaDecodeError(str(err), field=field) from err
    if forwardable and size == (height, width):
        return raw, size, True
    budget.hold_source(2 * 3 * width * height)
    try:
        frame = decode_rgb(raw, position)
    except MediaDecodeError as err:
        raise MediaDecodeError(f"{field} is not a PNG/JPEG image", field=field) from err
    if frame.shape[:2] != (height, width):  # an EXIF rotation: the rule applies to the upright image
        size = image_size(*frame.shape[:2], max_pixels=limits.max_pixels, min_pixels=limits.image_min_pixels)
    try:
        jpeg = frame_codec.encode_jpeg(np.ascontiguousarray(resize_frame(frame, *size)), limits.jpeg_quality)
    except ValueError as err:
        raise MediaDecodeError(str(err), field=field) from err
    return jpeg, size, False


def _upright(jpeg) -> bool:
    """No EXIF rotation (OpenCV would apply one, PIL and vLLM would not): its pixels mean one thing."""
    try:
        return jpeg.getexif().get(_EXIF_ORIENTATION, 1) == 1
    except Exception:  # noqa: BLE001 - unreadable EXIF: decode it here rather than forward it
        return False


def _load_npy(data: str, limits: FrameLimits) -> np.ndarray:
    raw = _b64decode(data, "frames_npy")
    try:
        array = read_uint8(raw)
    except NpyError as err:
        raise MediaDecodeError(f"frames_npy is not a uint8 .npy array: {err}", field="frames_npy") from err
    if array.ndim != 4 or array.shape[-1] != 3:
        raise MediaDecodeError(f"frames_npy must be uint8 with shape T×H×W×3, got shape {array.shape}",
                               field="frames_npy")
    if array.shape[1] * array.shape[2] > limits.max_source_pixels:
        raise MediaDecodeError("frames_npy frames are over the pixel cap", field="frames_npy")
    return array


def _check_inline_count(count: int, field: str, limits: FrameLimits) -> None:
    if count == 0:
        raise InvalidRequest(f"{field} holds no frames", field=field)
    if count > limits.max_inline_frames:
        raise InvalidRequest(f"{field} holds {count} frames, over the cap of "
                             f"{limits.max_inline_frames}", field=field)
