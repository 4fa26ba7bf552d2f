"""How a frame is brought to the size it is sent at and encoded: one rule for the proxy and for a
client that encodes its frames itself (rlinf_client), so both make the same pixels.

OpenCV is imported when first used: the client's base install has none, and without it the client
sends raw frames and the proxy does this work. `CODEC` names the rule; a change to it changes
every backend's frame rules id (vlm_protocol/frame_rules.py), so clients that encoded with the
old rule are told to send raw frames instead of being forwarded.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["CODEC", "available", "encode_jpeg", "resize_frame"]

CODEC = "opencv resize INTER_AREA down / INTER_CUBIC up; imencode .jpg of BGR, baseline, given quality"


def _cv2() -> Any:
    import cv2  # noqa: PLC0415 - optional on the client side (see the module docstring)

    return cv2


@functools.cache
def available() -> bool:
    """Whether OpenCV can be imported here (asked once)."""
    try:
        _cv2()
    except ImportError:
        return False
    return True


def resize_frame(frame: Any, height: int, width: int) -> Any:
    """RGB (or BGR) uint8 H×W×3 at height x width; the frame itself when it is that size already."""
    if frame.shape[0] == height and frame.shape[1] == width:
        return frame
    cv2 = _cv2()
    shrinking = height * width < frame.shape[0] * frame.shape[1]
    # INTER_AREA is the alias-free choice for shrinking; cubic for the rare upscale.
    interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_CUBIC
    try:
        return cv2.resize(frame, (width, height), interpolation=interpolation)
    except cv2.error as err:  # one error type for callers that do not import OpenCV
        raise ValueError(f"OpenCV cannot resize a {frame.shape} frame to {width}x{height}: {err}") from None


def encode_jpeg(frame_rgb: Any, quality: int) -> bytes:
    """One RGB uint8 frame as JPEG bytes; ValueError when OpenCV cannot encode it (resize_frame too)."""
    cv2 = _cv2()
    try:
        ok, buf = cv2.imencode(".jpg", cv2.cvtColor(frame_rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    except cv2.error as err:
        raise ValueError(f"OpenCV cannot encode the frame: {err}") from None
    if not ok:
        raise ValueError("JPEG encoding failed")
    return buf.tobytes()
