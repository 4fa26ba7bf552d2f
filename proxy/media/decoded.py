"""One source's frames as a request holds them: at the sizes they are sent, each made as its source
frame was decoded (`keep`), never the whole episode at source size. Lives inside one media-executor
call (proxy/media/budget.py): what leaves it is JPEG bytes."""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np

from proxy.errors import MediaDecodeError
from proxy.media.budget import DecodeBudget
from proxy.media.frame_plan import Size, resize_frame

__all__ = ["DecodedSource", "decode_rgb"]


def decode_rgb(raw: bytes, position: int) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(raw, dtype=np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        raise MediaDecodeError(f"frames[{position}] is not a PNG/JPEG image", field=f"frames[{position}]")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


@dataclass
class DecodedSource:
    """The wanted frames of one source (every prefix of a dense curve reads here).

    Inline RGB JPEGs already at a sent size are kept as their own bytes (forwarded as they came: no
    decode, no re-encode); `jpegs` also caches each JPEG made, by (index, height, width)."""

    count: int  # frames in the whole source (decoded, not what a container claimed)
    fps: float  # the source rate (the container's, the request's, or the default)
    field: str  # the request field they came from, for errors
    load_ms: float = 0.0
    sizes: dict[int, Size] = field(default_factory=dict)  # source (h, w) of every wanted frame decoded
    resized: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)  # (index, h, w) → RGB
    jpegs: dict[tuple[int, int, int], bytes] = field(default_factory=dict)
    source_frames: dict[int, np.ndarray] = field(default_factory=dict)  # frames_npy: views of the body, free
    forwarded: set[tuple[int, int, int]] = field(default_factory=set)  # the `jpegs` that are the caller's bytes
    stills: list[tuple[bytes, Size, bool]] = field(default_factory=list)  # the caller's own: JPEG, (h, w), forwarded

    def __contains__(self, index: int) -> bool:
        return index in self.sizes

    def keep(self, index: int, frame: np.ndarray, sizes: set[Size], budget: DecodeBudget, *,
             bgr: bool = False) -> None:
        """Bring a just-decoded source frame to each size it is sent at and keep only those."""
        self.sizes[index] = frame.shape[:2]
        for height, width in sorted(sizes):
            key = (index, height, width)
            if key in self.resized or key in self.jpegs:
                continue
            small = resize_frame(frame, height, width)  # per channel: BGR or RGB order gives the same pixels
            small = cv2.cvtColor(small, cv2.COLOR_BGR2RGB) if bgr else np.ascontiguousarray(small)
            budget.keep(small.nbytes)
            self.resized[key] = small

    def drop_except(self, needed: dict[int, set[Size]], budget: DecodeBudget) -> bool:
        """Keep only the (index, size) pairs in `needed`; False if one of them is missing."""
        for key in [k for k in self.resized if k[1:] not in needed.get(k[0], ())]:
            budget.release(self.resized.pop(key).nbytes)
        return all((i, *s) in self.resized or (i, *s) in self.jpegs for i, sizes in needed.items() for s in sizes)

    def clear(self, budget: DecodeBudget) -> None:
        for frame in self.resized.values():
            budget.release(frame.nbytes)
        self.resized.clear()
        self.sizes.clear()

    def frame_at(self, index: int, size: Size) -> np.ndarray:
        """The frame at `size`: kept at that size, or made now — from the npy view, the forwarded
        JPEG, or (a video frame planned for another size because a neighbour would not decode)
        from its largest kept size."""
        key = (index, *size)
        if key in self.resized:
            return self.resized[key]
        if index in self.source_frames:
            return resize_frame(self.source_frames[index], *size)
        source = (index, *self.sizes[index])
        if source in self.jpegs:
            return resize_frame(decode_rgb(self.jpegs[source], index), *size)
        kept = [k for k in self.resized if k[0] == index]
        if not kept:
            raise MediaDecodeError(f"frame {index} of the episode could not be decoded", field=self.field)
        largest = max(kept, key=lambda k: k[1] * k[2])
        return resize_frame(self.resized[largest], *size)
