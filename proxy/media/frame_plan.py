"""The sizes each source frame is sent at, known before it is decoded, so every frame is brought
to them as it is decoded and only those are kept (a request holds its sent-size frames plus one
source frame, never its frames at source size).

An episode (one /score, or one prefix of a /score/dense curve) is the list of source indices it
sends. Its video frames share one size (qwen-vl-utils' video rule over its frame count) and, with
`stills`, its first and last frame are also sent at the image rule's size. `media.encode_prefix`
asks the same `episode_sizes`, so what is kept is what is sent.
"""

from __future__ import annotations

from proxy.errors import MediaDecodeError
from vlm_protocol import frame_codec, frames

__all__ = ["Episodes", "Size", "episode_sizes", "planned_bytes", "resize_frame", "target_sizes"]

Size = tuple[int, int]  # (height, width)
Episodes = list[list[int]]  # each: the source indices one episode (or prefix) sends, increasing


resize_frame = frame_codec.resize_frame  # the client resizes with the same rule (vlm_protocol/frame_codec.py)


def episode_sizes(limits, height: int, width: int, count: int, field: str) -> tuple[Size, Size | None]:
    """(video frame size, still size or None) of an episode of `count` frames of height x width."""
    try:
        return frames.episode_sizes(height, width, count, max_pixels=limits.max_pixels, min_pixels=limits.min_pixels,
                                    video_max_pixels=limits.video_max_pixels, total_pixels=limits.total_pixels,
                                    image_min_pixels=limits.image_min_pixels, stills=limits.stills)
    except ValueError as err:
        raise MediaDecodeError(str(err), field=field) from err


def target_sizes(limits, episodes: Episodes, height: int, width: int, field: str) -> dict[int, set[Size]]:
    """Every size each source index is sent at, over all the episodes."""
    targets: dict[int, set[Size]] = {}
    for episode in episodes:
        if not episode:
            continue
        video, still = episode_sizes(limits, height, width, len(episode), field)
        for index in episode:
            targets.setdefault(index, set()).add(video)
        if still is not None:
            for index in (episode[0], episode[-1]):
                targets[index].add(still)
    return targets


def planned_bytes(targets: dict[int, set[Size]], height: int, width: int) -> int:
    """Decoded bytes the plan holds at its peak: one RGB source frame plus every kept frame."""
    return 3 * (height * width + sum(h * w for sizes in targets.values() for h, w in sizes))
