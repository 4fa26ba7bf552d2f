"""Episode frames on the client side: normalise, buffer with bounded memory, pick, encode.

Frames end up RGB uint8 T×H×W×3 whatever RLinf hands over: torch tensors or numpy, channels
first or last, uint8 or float ([0, 1] or [0, 255]). Nothing here imports torch or OpenCV at
module load (OpenCV only for the path transport).
"""

from __future__ import annotations

import base64
import bisect
import io
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rlinf_client._constants import OBS_IMAGE_KEYS
from rlinf_client._exceptions import FramesError, MissingDependencyError
from vlm_protocol import frame_codec
from vlm_protocol.frame_rules import FrameRules
from vlm_protocol.frames import sample_indices as _proxy_sample_indices

__all__ = [
    "EpisodeFrameBuffer",
    "PreparedFrames",
    "encode_npy",
    "encode_npy_b64",
    "encode_ready",
    "env_frames_from_obs",
    "frames_at_steps",
    "prepare_frames",
    "sample_indices",
    "to_uint8_frames",
    "write_temp_mp4",
]


def sample_indices(source_count: int, nframes: int) -> list[int]:
    """The proxy's own rule (vlm_protocol.frames, dependency-free), so client and proxy agree."""
    if source_count <= 0:
        raise FramesError("no frames to sample from")
    return _proxy_sample_indices(source_count, nframes)


def _as_numpy(data: Any) -> np.ndarray:
    if hasattr(data, "detach"):  # a torch tensor, possibly on a GPU
        data = data.detach().cpu().numpy()
    return np.asarray(data)


def to_uint8_frames(data: Any) -> np.ndarray:
    """RGB uint8 N×H×W×3 from N×H×W×3 or N×3×H×W (or one H×W×3 / 3×H×W frame).

    Floats whose maximum is at most 1 are taken as [0, 1] and scaled by 255; other floats are
    rounded and clipped to [0, 255].
    """
    array = _as_numpy(data)
    if array.ndim == 3:
        array = array[None]
    if array.ndim != 4:
        raise FramesError(f"frames must be N×H×W×3 or N×3×H×W, got shape {array.shape}")
    if array.shape[-1] != 3 and array.shape[1] == 3:
        array = array.transpose(0, 2, 3, 1)
    if array.shape[-1] != 3:
        raise FramesError(f"frames must have 3 colour channels, got shape {array.shape}")
    if array.shape[0] == 0 or array.shape[1] == 0 or array.shape[2] == 0:
        raise FramesError(f"frames are empty: shape {array.shape}")
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.number):
        raise FramesError(f"frames must be numeric, got dtype {array.dtype}")
    values = array.astype(np.float32, copy=False)
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(values).all():
            raise FramesError("frames hold NaN or infinite values")
        if values.size and float(values.max()) <= 1.0:
            values = values * 255.0
    return np.ascontiguousarray(np.clip(np.rint(values), 0, 255).astype(np.uint8))


def env_frames_from_obs(obs: Mapping[str, Any]) -> np.ndarray:
    """The agent-view frame of every env from one RLinf observation dict: uint8 N×H×W×3.

    Looks for `main_images` (RLinf now), `full_images` (Dec 2025, the seed's fork) and `images`
    (v0.1, channels first), in that order.
    """
    for key in OBS_IMAGE_KEYS:
        if obs.get(key) is not None:
            return to_uint8_frames(obs[key])
    raise FramesError(f"observation has none of {', '.join(OBS_IMAGE_KEYS)}; keys: {sorted(obs)}")


class EpisodeFrameBuffer:
    """One env's frames for one episode, at most `capacity` + 1 of them in memory.

    Keeps every `stride`-th step; when more than `capacity` are held the stride doubles and
    every other kept frame is dropped, so the frames held are always the multiples of the
    stride plus the latest one. Picking `nframes` is then exact (the proxy's indices) while
    the episode fits in `capacity`, and otherwise off by at most stride/2 steps per frame.
    `capacity=0` keeps every `stride`-th frame without bound.
    """

    def __init__(self, capacity: int, stride: int = 1) -> None:
        if capacity < 0 or stride < 1:
            raise ValueError("capacity must be >= 0 and stride >= 1")
        self.capacity = capacity
        self.initial_stride = stride
        self.clear()

    def clear(self) -> None:
        self.stride = self.initial_stride
        self.count = 0  # frames seen this episode
        self._indices: list[int] = []
        self._frames: list[np.ndarray] = []
        self._latest: tuple[int, np.ndarray] | None = None  # off-grid latest frame

    def __len__(self) -> int:
        return len(self._frames) + (self._latest is not None)

    @property
    def nbytes(self) -> int:
        held = sum(f.nbytes for f in self._frames)
        return held + (self._latest[1].nbytes if self._latest is not None else 0)

    def append(self, frame: np.ndarray) -> None:
        """Add the next step's frame (uint8 H×W×3; copied, since RLinf may reuse its arrays)."""
        index = self.count
        self.count += 1
        if index % self.stride:
            self._latest = (index, np.array(frame, copy=True))
            return
        self._latest = None
        copied = np.array(frame, copy=True)
        self._indices.append(index)
        self._frames.append(copied)
        if self.capacity and len(self._frames) > self.capacity:
            self.stride *= 2
            kept = [(i, f) for i, f in zip(self._indices, self._frames, strict=True)
                    if i % self.stride == 0]
            self._indices = [i for i, _ in kept]
            self._frames = [f for _, f in kept]
            if index % self.stride:  # the newest frame fell off the grid: keep it as the latest
                self._latest = (index, copied)

    def held(self) -> tuple[list[int], list[np.ndarray]]:
        """(source step indices, frames) of everything held, in order."""
        indices, frames = list(self._indices), list(self._frames)
        if self._latest is not None:
            indices.append(self._latest[0])
            frames.append(self._latest[1])
        return indices, frames

    def sample(self, nframes: int) -> tuple[list[int], list[np.ndarray]]:
        """The held frames nearest to the proxy's uniform indices over the whole episode."""
        indices, frames = self.held()
        if not frames:
            raise FramesError("the episode has no frames")
        picked: list[int] = []
        for target in sample_indices(self.count, nframes):
            pos = bisect.bisect_left(indices, target)
            candidates = [p for p in (pos - 1, pos) if 0 <= p < len(indices)]
            best = min(candidates, key=lambda p: (abs(indices[p] - target), -p))
            if not picked or picked[-1] != best:
                picked.append(best)
        return [indices[p] for p in picked], [frames[p] for p in picked]


@dataclass(frozen=True)
class PreparedFrames:
    frames: np.ndarray  # uint8 K×H×W×3, what goes on the wire
    source_indices: list[int]  # their steps in the episode
    source_count: int  # steps in the episode

    @property
    def count(self) -> int:
        return int(self.frames.shape[0])


def prepare_frames(source: Any, nframes: int, client_sampling: bool) -> PreparedFrames:
    """The frames to send for one episode: the `nframes` picked here (client_sampling) or all
    that are held, letting the proxy pick. `source` is an EpisodeFrameBuffer or array-like."""
    if isinstance(source, EpisodeFrameBuffer):
        indices, frames = source.sample(nframes) if client_sampling else source.held()
        return PreparedFrames(to_uint8_frames(np.stack(frames)), indices, source.count)
    if isinstance(source, Sequence) and not isinstance(source, np.ndarray):
        if len(source) == 0:
            raise FramesError("the episode has no frames")
        count = len(source)
        indices = sample_indices(count, nframes) if client_sampling else list(range(count))
        picked = np.stack([to_uint8_frames(source[i])[0] for i in indices])
        return PreparedFrames(picked, indices, count)
    array = _as_numpy(source)
    if array.ndim != 4 or array.shape[0] == 0:
        raise FramesError(f"an episode must be T×H×W×3 or T×3×H×W with T >= 1, got {array.shape}")
    count = int(array.shape[0])
    # Normalise only what is sent: cheap even for a 512-step float episode.
    indices = sample_indices(count, nframes) if client_sampling else list(range(count))
    return PreparedFrames(to_uint8_frames(array[indices]), indices, count)


def frames_at_steps(source: Any, picked: PreparedFrames) -> np.ndarray:
    """A second camera's frames at the steps picked from the main view (uint8 K×H×W×3): the same
    episode, so the same step count; a step it does not hold is an error, never a neighbour."""
    if isinstance(source, EpisodeFrameBuffer):
        count = source.count
        steps, frames = source.held()
        held = dict(zip(steps, frames, strict=True))
    elif isinstance(source, Sequence) and not isinstance(source, np.ndarray):
        count, held = len(source), None
    else:
        source = _as_numpy(source)
        count, held = (int(source.shape[0]) if source.ndim == 4 else 0), None
    if count != picked.source_count:
        raise FramesError(f"the second camera holds {count} steps and the main view {picked.source_count}: "
                          "the two views of one episode must be recorded at the same steps")
    if held is None:
        return to_uint8_frames(np.stack([to_uint8_frames(source[i])[0] for i in picked.source_indices]))
    missing = [step for step in picked.source_indices if step not in held]
    if missing:
        raise FramesError(f"the second camera's buffer does not hold steps {missing[:5]} the main view's does "
                          "(both buffers must be filled at every step)")
    return to_uint8_frames(np.stack([held[step] for step in picked.source_indices]))


def encode_npy(frames: np.ndarray) -> bytes:
    """A .npy file's bytes (transport: binary sends them raw)."""
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(frames, dtype=np.uint8), allow_pickle=False)
    return buffer.getvalue()


def encode_npy_b64(frames: np.ndarray) -> str:
    """base64 of a .npy file: the proxy's `frames_npy`."""
    return base64.b64encode(encode_npy(frames)).decode("ascii")


def encode_ready(frames: np.ndarray, rules: FrameRules,
                 max_pixels: int | None) -> tuple[list[bytes], list[bytes]] | None:
    """The picked frames as JPEGs at the size the proxy sends them, and the two stills (first and
    last frame at the image rule's size) when the backend's layout has them: what the proxy forwards
    untouched. Same rule as the proxy's (vlm_protocol: frame sizes, frame_codec: resize and JPEG).
    None when this cannot be done here (no OpenCV; a frame size no budget takes): send raw frames."""
    try:
        (height, width), still = rules.sizes(frames.shape[1], frames.shape[2], frames.shape[0], max_pixels)
        # The proxy sizes what it receives again: only sizes its rule keeps are sent ready (a budget
        # below the video floor, or a very thin frame, is not; the proxy then sizes the raw frames).
        again, _ = rules.sizes(height, width, frames.shape[0], max_pixels)
        if again != (height, width) or (still is not None and rules.sizes(*still, 1, max_pixels)[1] != still):
            return None
        jpegs = [frame_codec.encode_jpeg(np.ascontiguousarray(frame_codec.resize_frame(f, height, width)),
                                         rules.jpeg_quality) for f in frames]
        stills = [] if still is None else [
            frame_codec.encode_jpeg(np.ascontiguousarray(frame_codec.resize_frame(f, *still)), rules.jpeg_quality)
            for f in (frames[0], frames[-1])]
    except (ImportError, ValueError):
        return None
    return jpegs, stills


def write_temp_mp4(frames: np.ndarray, fps: float, directory: str | None) -> str:
    """Write frames to a new temporary MP4 (mp4v) and return its path; the caller deletes it."""
    try:
        import cv2
    except ImportError as err:
        raise MissingDependencyError(
            "transport: path writes an MP4 with OpenCV; install opencv-python-headless "
            "(or use transport: inline, which needs no OpenCV and no shared filesystem)") from err
    try:
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="rlinf-episode-", suffix=".mp4", dir=directory)
        os.close(fd)
    except OSError as e:  # a bad temp_video_dir, a full disk: the failure policy applies
        raise FramesError(f"cannot write temp MP4: {e}") from e
    height, width = frames.shape[1:3]
    writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (width, height))
    try:
        if not writer.isOpened():
            raise FramesError(f"OpenCV cannot write an mp4v video to {path}")
        for frame in frames:
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    except BaseException:
        writer.release()
        os.unlink(path)
        raise
    writer.release()
    return path
