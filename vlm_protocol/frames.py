"""The pure frame rules: which frames of an episode to send, and at what size.

No third-party imports, so the RLinf client can sample exactly as the proxy does before it
sends anything (sending a whole 512-frame episode inline costs ~10x more than sampling first).
"""

from __future__ import annotations

import math

__all__ = ["MAX_ASPECT_RATIO", "PATCH_FACTOR", "sample_indices", "smart_resize"]

# Qwen2.5-VL: 14-pixel patches merged 2×2, so sides are multiples of 28.
PATCH_FACTOR = 28
MAX_ASPECT_RATIO = 200


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
    height: int, width: int, *, factor: int = PATCH_FACTOR, min_pixels: int, max_pixels: int
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


