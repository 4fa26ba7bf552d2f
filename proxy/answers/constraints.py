r"""The regex that holds a reply to a template's declared answer, for vLLM's structured outputs.

vLLM 0.32 honours `structured_outputs: {"regex": …}` in a chat request (the older `guided_regex`
field is silently ignored there, so it is never sent). The pattern follows the declared answer:

    untagged, 0-100          (100|99|…|1|0)
    <score>, 0-100           <score>(100|…|0)</score>
    0-1                      (0(\.\d{1,3})?|1(\.0{1,3})?)
    binary                   (yes|no)
    reasoning, <answer>      <think>[\s\S]*</think>\s*<answer>(100|…|0)</answer>
    label "ANSWER:", 1-5     ANSWER: (5|4|3|2|1)
    per_frame, 3 frames      Frame 1: …:(100|…|0)%\nFrame 2: …%\nFrame 3: …%   (per_frame.py)

An integer scale is spelled out value by value (up to 1000 values), so the reply is always ON the
scale: a random-weight model constrained this way answers a score, where `\d{1,3}` let it answer
613 (measured on the real tiny vLLM) and the parser then refused it. Wider integer scales and other
fractional ones bound the digits only; the parser still checks the range.
"""

from __future__ import annotations

import math
import re

from proxy.answers.parse import AnswerSpec
from proxy.answers.per_frame import reply_pattern

__all__ = ["answer_regex"]


ENUMERATED_VALUES = 1000


def _value(spec: AnswerSpec) -> str:
    scale = spec.scale
    if scale.binary:
        return "(yes|no)"
    lo, hi = scale.min, scale.max
    if lo == int(lo) and hi == int(hi) and hi > 1 and lo >= 0 and hi - lo < ENUMERATED_VALUES:
        return "(" + "|".join(str(v) for v in range(int(hi), int(lo) - 1, -1)) + ")"
    if (lo, hi) == (0, 1):
        return r"(0(\.\d{1,3})?|1(\.0{1,3})?)"
    digits = len(str(int(math.floor(hi))))
    return rf"\d{{1,{digits}}}(\.\d{{1,3}})?"


def answer_regex(spec: AnswerSpec, shown: int | None = None) -> str:
    """`shown`: a per-frame answer's frame count (one line each, frames 1..shown in order)."""
    if spec.probability:  # its number is the logprobs': a constraint would renormalise them (vLLM masks first)
        raise ValueError("a probability answer is never constrained")
    value = _value(spec)
    if spec.per_frame:
        if not shown:
            raise ValueError("a per-frame answer's constraint needs the number of frames shown")
        return "\n".join(reply_pattern(spec.per_frame, value=value, shown=str(n)) for n in range(1, shown + 1))
    if spec.label:
        answer = re.escape(spec.label) + " " + value
    else:
        answer = f"<{spec.tags[0]}>{value}</{spec.tags[0]}>" if spec.tags else value
    if spec.reasoning:
        return r"<think>[\s\S]*</think>\s*" + answer
    return answer
