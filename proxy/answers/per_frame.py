"""A per-frame answer (GVL, arXiv 2411.04549): k frames shown as numbered images in a shuffled
order, one completion value per image in one reply; un-shuffled, a progress curve from ONE call.

The template declares how a frame is named and how a reply line reads:

    answer:
      per_frame: {label: "Frame {i}:", reply: "Frame {i}: Task Completion Percentages: {value}%"}
      scale: {min: 0, max: 100}

The reply must hold exactly one line per shown frame (1..k, any order), each value on the scale:
a frame without a value, or with two, is no curve. The constraint (constraints.py) writes the lines
for frames 1..k in order, so every reply it allows parses.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import Any

from proxy.answers.parse import AnswerSpec, ParsedScore, PerFrame, refuse_cut, strip_reasoning
from proxy.errors import ScoreParseError

__all__ = ["Shuffle", "parse_per_frame", "reply_pattern", "shuffle_for", "shuffle_order"]

_NUMBER = r"(\d+(?:\.\d+)?)"


@dataclass(frozen=True)
class Shuffle:
    """Which frame is shown where: order[n] is the time index (0-based, among the frames after the
    reference) of the frame shown as number n + 1."""

    seed: int
    order: tuple[int, ...]


def shuffle_order(count: int, seed: int) -> Shuffle:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    return Shuffle(seed, tuple(order))


def shuffle_for(frames: Any, seed: int | None) -> Shuffle:
    """The shown order of the frames after the reference (frames.sha256[0]): from `seed`, else from
    the frames themselves, so an episode is shown the same way every time (a replay too) and two
    episodes differently (a fixed order would teach a position)."""
    if seed is None:
        seed = int(hashlib.sha256("".join(frames.sha256).encode()).hexdigest()[:15], 16)
    return shuffle_order(len(frames.sha256) - 1, seed)


def reply_pattern(per_frame: PerFrame, value: str = _NUMBER, shown: str = r"(\d+)") -> str:
    """The regex of one reply line, the frame number and the value as groups (or as given)."""
    before_i, _, rest = per_frame.reply.partition("{i}")
    between, _, after = rest.partition("{value}")
    return re.escape(before_i) + shown + re.escape(between) + value + re.escape(after)


def parse_per_frame(text: str, spec: AnswerSpec, shuffle: Shuffle, *, finish_reason: str | None
                    ) -> tuple[list[ParsedScore], dict[int, float]]:
    """(each frame's value in time order, the values by shown number) from one reply."""
    per_frame, scale, count = spec.per_frame, spec.scale, len(shuffle.order)
    assert per_frame is not None

    def fail(reason: str) -> ScoreParseError:
        return ScoreParseError(f"{reason}; the template asks for {count} lines like {per_frame.reply!r}, one per "
                               f"frame 1..{count}, each value on the {scale.name} scale",
                               output_text=text, finish_reason=finish_reason)

    refuse_cut(finish_reason, fail)
    shown: dict[int, float] = {}
    for match in re.finditer(reply_pattern(per_frame), strip_reasoning(text or "")):
        number, raw = int(match.group(1)), float(match.group(2))
        if not 1 <= number <= count:
            raise fail(f"a value for frame {number}, which was not shown")
        if number in shown:
            raise fail(f"two values for frame {number}")
        if scale.normalise(raw) is None:
            raise fail(f"frame {number}'s value {raw:g} is not on the {scale.name} scale")
        shown[number] = raw
    missing = [n for n in range(1, count + 1) if n not in shown]
    if missing:
        raise fail(f"no value for frame{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}")
    in_time = [0.0] * count
    for number, raw in shown.items():
        in_time[shuffle.order[number - 1]] = raw
    return [ParsedScore(scale.normalise(raw), raw, "per_frame", scale.name, "auto") for raw in in_time], shown
