"""Where an episode's frames come from: a video file under an allowed root, base64 images, or a
base64 .npy array — decoded once, only at the indices wanted, as RGB uint8 arrays.

`decode_source` takes a `wanted_for(frame count) -> indices` rule instead of a frame count, so
one pass serves one sampled episode (/score) and the union of many prefixes (/score/dense).
Blocking CPU work: callers run it in a worker thread.
"""

from __future__ import annotations

import binascii
import io
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pybase64  # SIMD base64, the decoder vLLM uses: 3.2 MB in 0.14 ms vs 6.5 ms

from proxy.errors import InvalidRequest, MediaDecodeError, MediaForbidden, MediaNotFound
from proxy.npy import NpyError, read_uint8
from proxy.parts import part_bytes
from vlm_protocol.multipart import PART_PREFIX

__all__ = ["DecodedSource", "FrameLimits", "decode_source", "prefix_count", "resolve_media_path"]

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


@dataclass
class DecodedSource:
    """One source's frames at the wanted indices (every prefix of a dense curve reads here).

    Inline RGB JPEGs are kept as their own bytes and decoded only if they must be resized: a frame
    already at the size the backend wants is forwarded as it came (no decode, no re-encode)."""

    frames: dict[int, np.ndarray]  # decoded RGB
    count: int  # frames in the whole source (decoded, not what a container claimed)
    fps: float  # the source rate (the container's, the request's, or the default)
    field: str  # the request field they came from, for errors
    load_ms: float
    jpegs: dict[tuple[int, int, int], bytes] = field(default_factory=dict)  # (index, h, w) → JPEG, reused
    sizes: dict[int, tuple[int, int]] = field(default_factory=dict)  # (h, w) of every wanted frame

    def __contains__(self, index: int) -> bool:
        return index in self.sizes

    def take(self, indices: list[int]) -> list[np.ndarray]:
        """Decoded frames (a kept JPEG is decoded now, once)."""
        for i in indices:
            if i not in self.frames:
                self.frames[i] = _decode_rgb(self.jpegs[(i, *self.sizes[i])], i)
        return [self.frames[i] for i in indices]


def prefix_count(count: int, prefix_end: int | None) -> int:
    """Frames an episode has when it is cut after source frame `prefix_end` (None: all)."""
    if prefix_end is None:
        return count
    if prefix_end >= count:
        raise InvalidRequest(f"prefix_end {prefix_end} is past the episode's last frame ({count - 1})",
                             field="prefix_end")
    return prefix_end + 1


def resolve_media_path(video_path: str, allowed_roots: list[Path]) -> Path:
    """The real file behind `video_path`, only if it lies under an allowed root (symlinks resolved)."""
    if not allowed_roots:
        raise MediaForbidden("video_path is disabled: proxy.allowed_media_roots is empty",
                             field="video_path")
    if "\x00" in video_path:
        raise InvalidRequest("video_path holds a NUL character", field="video_path")
    raw = Path(video_path)
    if not raw.is_absolute():
        raise InvalidRequest("video_path must be an absolute path", field="video_path")
    try:
        resolved = raw.resolve()
    except (OSError, RuntimeError) as err:  # symlink loop, name too long, ...
        raise MediaNotFound(f"video_path cannot be resolved: {type(err).__name__}", field="video_path") from err
    if not any(resolved.is_relative_to(root.resolve()) for root in allowed_roots):
        # Say nothing about whether the file exists: that would leak the filesystem.
        raise MediaForbidden("video_path is outside proxy.allowed_media_roots", field="video_path")
    try:
        is_file = resolved.is_file()
    except OSError:
        is_file = False
    if not is_file:
        raise MediaNotFound(f"video_path {video_path!r} does not exist or is not a file",
                            field="video_path")
    return resolved


def decode_source(limits: FrameLimits, wanted_for: Callable[[int], list[int]], *,
                  video_path: Path | None = None, frames: list[str] | None = None,
                  frames_npy: str | None = None, fps: float | None = None) -> DecodedSource:
    """Decode the frames `wanted_for(count)` names, from the one source given."""
    started = time.perf_counter()
    source_fps = fps or limits.default_source_fps
    if video_path is not None:
        decoded, count, source_fps = _read_video(video_path, limits, wanted_for)
        name = "video_path"
    elif frames is not None:
        _check_inline_count(len(frames), "frames", limits)
        count, name = len(frames), "frames"
        source = DecodedSource({}, count, source_fps, name, 0.0)
        for i in wanted_for(count):  # only the kept ones
            _read_image(frames[i], i, limits, source)
        source.load_ms = (time.perf_counter() - started) * 1e3
        return source
    elif frames_npy is not None:
        array = _load_npy(frames_npy, limits)
        _check_inline_count(array.shape[0], "frames_npy", limits)
        count, name = array.shape[0], "frames_npy"
        decoded = {i: array[i] for i in wanted_for(count)}
    else:
        raise InvalidRequest("no frame source given", field="video_path")
    return DecodedSource(frames=decoded, count=count, fps=source_fps, field=name,
                         load_ms=(time.perf_counter() - started) * 1e3,
                         sizes={i: f.shape[:2] for i, f in decoded.items()})


def _read_video(path: Path, limits: FrameLimits, wanted_for: Callable[[int], list[int]]
                ) -> tuple[dict[int, np.ndarray], int, float]:
    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise MediaDecodeError(f"cannot open {path.name} as a video", field="video_path")
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if width * height > limits.max_source_pixels:
            raise MediaDecodeError(f"video frames are {width}x{height}, over the "
                                   f"{limits.max_source_pixels}-pixel cap", field="video_path")
        fps = capture.get(cv2.CAP_PROP_FPS)
        reported = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        wanted = _wanted_if_valid(wanted_for, reported) if reported > 0 else None
        frames, decoded = _grab_at(capture, wanted)
    finally:
        capture.release()
    if decoded == 0:
        raise MediaDecodeError(f"{path.name} has no decodable frames", field="video_path")
    if decoded != reported or wanted is None:
        # Container metadata lied (common for truncated files): pick again over what exists.
        capture = cv2.VideoCapture(str(path))
        try:
            frames, decoded = _grab_at(capture, wanted_for(decoded))
        finally:
            capture.release()
    source_fps = fps if fps and math.isfinite(fps) and fps > 0 else limits.default_source_fps
    return frames, decoded, source_fps


def _wanted_if_valid(wanted_for: Callable[[int], list[int]], reported: int) -> list[int] | None:
    """The pick over the container's frame count; None when that count cannot satisfy the request
    (a prefix past it): the decoded count, not the container's claim, decides that error."""
    try:
        return wanted_for(reported)
    except InvalidRequest:
        return None


def _grab_at(capture, wanted: list[int] | None) -> tuple[dict[int, np.ndarray], int]:
    """Decode sequentially, converting only wanted frames; returns ({index: frame}, total)."""
    wanted_set = set(wanted or ())
    frames: dict[int, np.ndarray] = {}
    index = 0
    while capture.grab():
        if index in wanted_set:
            ok, bgr = capture.retrieve()
            if ok:
                frames[index] = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
        index += 1
    return frames, index


def _b64decode(data: str, field: str) -> bytes:
    if data.startswith(PART_PREFIX):  # a raw part of a binary (multipart) body: no base64 at all
        return part_bytes(data, field)
    if data.startswith("data:"):
        data = data.partition(",")[2]
    try:
        return pybase64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise MediaDecodeError(f"{field} is not valid base64", field=field) from err


def _read_image(data: str, position: int, limits: FrameLimits, into: DecodedSource) -> None:
    """One inline image into `into`: an RGB JPEG kept as its bytes (decoded only if it must be
    resized), anything else decoded now. The header is read first, so a decompression bomb is
    refused before it is decoded."""
    raw = _b64decode(data, f"frames[{position}]")
    try:
        from PIL import Image

        with Image.open(io.BytesIO(raw)) as probe:
            (width, height) = probe.size
            forwardable = probe.format == "JPEG" and probe.mode == "RGB" and _upright(probe)
    except Exception as err:  # noqa: BLE001 - any PIL failure means "not an image we can read"
        raise MediaDecodeError(f"frames[{position}] is not a PNG/JPEG image",
                               field=f"frames[{position}]") from err
    if width * height > limits.max_source_pixels:
        raise MediaDecodeError(f"frames[{position}] is {width}x{height}, over the "
                               f"{limits.max_source_pixels}-pixel cap", field=f"frames[{position}]")
    # A cut JPEG (no end-of-image marker) is decoded here and fails as this request's own error;
    # other damage inside one surfaces as vLLM's 400, a rejected request (tests/real_vllm).
    if forwardable and raw.rstrip(b"\x00").endswith(b"\xff\xd9"):
        into.sizes[position] = (height, width)  # forwardable: vLLM decodes these bytes to these pixels
        into.jpegs[(position, height, width)] = raw
    else:
        frame = _decode_rgb(raw, position)  # OpenCV applies an EXIF rotation: its shape is the truth
        into.sizes[position] = frame.shape[:2]
        into.frames[position] = frame


def _upright(jpeg) -> bool:
    """No EXIF rotation (OpenCV would apply one, PIL and vLLM would not): its pixels mean one thing."""
    try:
        return jpeg.getexif().get(_EXIF_ORIENTATION, 1) == 1
    except Exception:  # noqa: BLE001 - unreadable EXIF: decode it here rather than forward it
        return False


def _decode_rgb(raw: bytes, position: int) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(raw, dtype=np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise MediaDecodeError(f"frames[{position}] is not a PNG/JPEG image", field=f"frames[{position}]")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


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
