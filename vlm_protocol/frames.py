"""The pure frame rules: which frames of an episode to send, at what size, at what rate.

No third-party imports, so the RLinf client can sample exactly as the proxy does before it
sends anything (sending a whole 512-frame episode inline costs ~10x more than sampling first).

Sizes follow qwen-vl-utils (the seed and PRIMO-R1 prepare inputs with it), parity-tested
against the package itself:
- an image: `smart_resize` within [IMAGE_MIN_PIXELS, max_pixels];
- a video of N frames: each frame within [min_pixels, per-frame cap], where the cap is
  max(min(VIDEO_MAX_PIXELS, total_pixels / N * 2), 1.05 * min_pixels), lowered further by a
  requested max_pixels (qwen-vl-utils >= 0.0.9). VIDEO_MIN_PIXELS is a floor: LIBERO's 256x256
  frames become 336x336 (144 tokens per 2 frames), as the seed's server sent them.
"""

from __future__ import annotations

import math

__all__ = ["FRAME_FACTOR", "IMAGE_MIN_PIXELS", "MAX_ASPECT_RATIO", "PATCH_FACTOR", "VIDEO_MAX_PIXELS",
           "VIDEO_MIN_PIXELS", "VIDEO_TOTAL_PIXELS", "image_size", "sample_indices", "smart_resize",
           "episode_sizes", "video_frame_size", "vision_tokens"]

# Qwen2.5-VL: 14-pixel patches merged 2×2, so sides are multiples of 28.
PATCH_FACTOR = 28
MAX_ASPECT_RATIO = 200
# qwen-vl-utils' constants (0.0.9 … 0.0.14 agree).
FRAME_FACTOR = 2  # frames per temporal patch
IMAGE_MIN_PIXELS = 4 * 28 * 28
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_TOTAL_PIXELS = int(128000 * 28 * 28 * 0.9)  # its default budget across a video's frames


def sample_indices(source_count: int, nframes: int) -> list[int]:
    """`nframes` indices spread uniformly over the episode, always keeping the first and last.

    Fewer frames than asked → all of them. One frame → the last (the final state is where
    success shows). Rounds half up: numpy's half-to-even could repeat an index.
    """
    if source_count <= 0:
        raise ValueError("no frames to sample from")
    if nframes <= 0:
        raise ValueError("nframes must be positive")
    if nframes >= source_count:
        return list(range(source_count))
    if nframes == 1:
        return [source_count - 1]
    step = (source_count - 1) / (nframes - 1)
    return [int(math.floor(i * step + 0.5)) for i in range(nframes)]


def _round_by(x: float, factor: int) -> int:
    return round(x / factor) * factor


def _floor_by(x: float, factor: int) -> int:
    return math.floor(x / factor) * factor


def _ceil_by(x: float, factor: int) -> int:
    return math.ceil(x / factor) * factor


def smart_resize(
    height: int, width: int, *, factor: int = PATCH_FACTOR, min_pixels: float, max_pixels: float
) -> tuple[int, int]:
    """Qwen's rule: sides multiples of `factor`, area within [min_pixels, max_pixels], aspect kept.

    Returns (height, width). Must agree with qwen_vl_utils.smart_resize (parity-tested).
    """
    if min(height, width) <= 0:
        raise ValueError(f"frame size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"aspect ratio of {width}x{height} is over {MAX_ASPECT_RATIO}, Qwen cannot take it"
        )
    h_bar = max(factor, _round_by(height, factor))
    w_bar = max(factor, _round_by(width, factor))
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = _floor_by(height / beta, factor)
        w_bar = _floor_by(width / beta, factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = _ceil_by(height * beta, factor)
        w_bar = _ceil_by(width * beta, factor)
    if h_bar == 0 or w_bar == 0:
        # The reference returns a 0 side here (a thin frame on a small budget); refuse instead.
        raise ValueError(f"a {width}x{height} frame cannot fit max_pixels {max_pixels} with "
                         f"{factor}-pixel sides; raise max_pixels")
    return h_bar, w_bar


def image_size(height: int, width: int, *, max_pixels: int, min_pixels: int = IMAGE_MIN_PIXELS) -> tuple[int, int]:
    """(height, width) of a still image (PRIMO-R1's first and last frames)."""
    return smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)


def video_frame_size(height: int, width: int, nframes: int, *, max_pixels: int | None = None,
                     min_pixels: int = VIDEO_MIN_PIXELS, video_max_pixels: int = VIDEO_MAX_PIXELS,
                     total_pixels: int = VIDEO_TOTAL_PIXELS) -> tuple[int, int]:
    """(height, width) of every frame of an `nframes`-frame video, by qwen-vl-utils' video rule."""
    cap = max(min(video_max_pixels, total_pixels / nframes * FRAME_FACTOR), int(min_pixels * 1.05))
    if max_pixels is not None:
        cap = min(max_pixels, cap)
    return smart_resize(height, width, min_pixels=min_pixels, max_pixels=cap)  # a float, as there


def episode_sizes(height: int, width: int, count: int, *, max_pixels: int, min_pixels: int,
                  video_max_pixels: int, total_pixels: int, image_min_pixels: int,
                  stills: bool) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(video frame size, still size or None) of a `count`-frame episode of height x width frames:
    what the proxy sends them at, and what a client that encodes them itself must match."""
    video = video_frame_size(height, width, count, max_pixels=max_pixels, min_pixels=min_pixels,
                             video_max_pixels=video_max_pixels, total_pixels=total_pixels)
    still = image_size(height, width, max_pixels=max_pixels, min_pixels=image_min_pixels) if stills else None
    return video, still


def vision_tokens(height: int, width: int, frames: int = 1, *, video: bool) -> int:
    """Qwen2.5-VL's prompt tokens for one image or video part, its start/end tokens included."""
    grid = (height // PATCH_FACTOR) * (width // PATCH_FACTOR)
    return (math.ceil(frames / FRAME_FACTOR) if video else 1) * grid + 2
