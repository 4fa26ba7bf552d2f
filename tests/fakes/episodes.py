"""Synthetic episodes: frames whose content encodes their index, so order can be checked."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import cv2
import numpy as np


def episode_frames(count: int, height: int = 224, width: int = 224) -> np.ndarray:
    """uint8 T×H×W×3; frame i is a flat grey of brightness ~ i, plus a coloured corner marker."""
    frames = np.empty((count, height, width, 3), dtype=np.uint8)
    for i in range(count):
        level = int(round(20 + 215 * i / max(1, count - 1)))
        frames[i] = level
        frames[i, : height // 8, : width // 8] = (255, 0, 0)  # red marker: checks RGB order
    return frames


def frame_level(rgb: np.ndarray) -> float:
    """The grey level a decoded frame encodes (its lower-right quarter, away from the marker)."""
    h, w = rgb.shape[:2]
    return float(rgb[h // 2 :, w // 2 :].mean())


def write_mp4(path: Path, frames: np.ndarray, fps: float = 20.0) -> Path:
    return _write_video(path, frames, fps, "mp4v")


def _write_video(path: Path, frames: np.ndarray, fps: float, fourcc: str) -> Path:
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {fourcc} here")
    for frame in frames:
        writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def npy_b64(frames: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, frames, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def images_b64(frames: np.ndarray, ext: str = ".png") -> list[str]:
    out = []
    for frame in frames:
        ok, buf = cv2.imencode(ext, cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
        assert ok
        out.append(base64.b64encode(buf.tobytes()).decode("ascii"))
    return out


def decode_jpeg_b64(data: str) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(data, validate=True), dtype=np.uint8)
    return cv2.cvtColor(cv2.imdecode(raw, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def write_lossless_video(path: Path, frames: np.ndarray, fps: float = 20.0) -> Path:
    """FFV1 in AVI: decodes to exactly `frames` (for tests that compare bytes across transports)."""
    return _write_video(path, frames, fps, "FFV1")
