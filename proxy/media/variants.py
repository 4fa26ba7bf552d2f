"""An episode's sent frames in another order, for the invariance probes: reversed, or shuffled
by a seed. Pure: the JPEGs are reordered, never re-encoded."""

from __future__ import annotations

import dataclasses
import random

from proxy.media.encode import EncodedFrames

__all__ = ["reversed_frames", "shuffled_frames"]


def reversed_frames(frames: EncodedFrames) -> EncodedFrames:
    """The episode played backwards: frames and the first/last stills swapped end for end (a second
    camera's video too)."""
    return dataclasses.replace(frames, jpegs=frames.jpegs[::-1], indices=frames.indices[::-1],
                               stills=frames.stills[::-1], extra=frames.extra and reversed_frames(frames.extra))


def shuffled_frames(frames: EncodedFrames, seed: str) -> tuple[EncodedFrames, list[int]]:
    """The frames in a seeded random order (never the original order when there are 2 or more);
    the stills stay the episode's first and last frame."""
    order = list(range(len(frames.jpegs)))
    rng = random.Random(seed)
    while len(order) > 1 and order == sorted(order):
        rng.shuffle(order)
    extra = frames.extra and dataclasses.replace(frames.extra, jpegs=[frames.extra.jpegs[i] for i in order],
                                                 indices=[frames.extra.indices[i] for i in order])
    return dataclasses.replace(frames, jpegs=[frames.jpegs[i] for i in order],
                               indices=[frames.indices[i] for i in order], extra=extra), order
