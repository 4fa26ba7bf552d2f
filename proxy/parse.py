"""Score extraction: from a model's reply text to a number in [0, 1], or a ScoreParseError.

Order of rules (first match wins), applied after removing <think>…</think> so that numbers in
the reasoning never win:
    answer_tag    <answer>85</answer>          score_tag  <score>0.7</score>
    score_marker  [SCORE] 7/10, SCORE: 7       double_bracket  [[8]]
    percent       85%                          fraction   7/10, 3 out of 4
    bare_number   exactly one number in the text (several numbers are ambiguous: an error)
    yes_no        score_mode binary only: the reply is a verdict, "Yes." / "No, it fell"
                  (in a tag, a verdict counts in any mode: the model put it in the answer slot)
Inside a tag the same number forms apply (85, 85%, 7/10, yes). Out-of-range values are errors,
never clamped: a model that says 150% did not answer the question.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from proxy.errors import ScoreParseError

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.S | re.I)
_THINK_UNCLOSED = re.compile(r"<think>.*\Z", re.S | re.I)  # truncated reasoning: all of it goes
# A template that opens <think> in the prompt: the reply starts inside the reasoning.
_THINK_ORPHAN_CLOSE = re.compile(r"\A.*</think>", re.S | re.I)
_TAGS = [
    ("answer_tag", re.compile(r"<answer>(.*?)</answer>", re.S | re.I)),
    ("score_tag", re.compile(r"<score>(.*?)</score>", re.S | re.I)),
]
_SCORE_MARKER = re.compile(
    r"\[?\bSCORE\]?\s*[:=]?\s*(" + _NUMBER + r"(?:\s*(?:%|(?:/|out\s+of)\s*\d+(?:\.\d+)?))?)", re.I)
_DOUBLE_BRACKET = re.compile(r"\[\[\s*(" + _NUMBER + r")\s*\]\]")
_PERCENT = re.compile(r"(" + _NUMBER + r")\s*%")
_FRACTION = re.compile(r"(" + _NUMBER + r")\s*(?:/|out of)\s*(\d+(?:\.\d+)?)", re.I)
_ANY_NUMBER = re.compile(_NUMBER)
# A verdict word counts only as the whole answer or its first word before punctuation:
# "Yes." / "No, it fell" — never "no idea" or "not sure", which are not answers.
_VERDICT = re.compile(
    r"^\W*(yes|no|success|successful|succeeded|fail|failed|failure|unsuccessful|true|false)"
    r"\s*(?:$|[.,;:!])", re.I)
_POSITIVE = {"yes", "success", "successful", "succeeded", "true"}

MODES = ("auto", "percentage", "unit", "binary")


@dataclass(frozen=True)
class ParsedScore:
    score: float  # normalised to [0, 1]
    raw_score: float  # as the model wrote it
    source: str  # the rule that matched
    mode: str


def strip_reasoning(text: str) -> str:
    return _THINK_UNCLOSED.sub("", _THINK_ORPHAN_CLOSE.sub("", _THINK_BLOCK.sub("", text)))


def _normalise(raw: float, scale: float | None, mode: str, source: str) -> float:
    """scale: 100 for x%, N for x/N, None for a plain number."""
    if not math.isfinite(raw) or (scale is not None and not math.isfinite(scale)):
        raise ScoreParseError(f"{source} holds a number past float range")
    if scale is not None:
        value = raw / scale
    elif mode == "percentage":
        value = raw / 100.0
    elif mode in ("unit", "binary"):
        value = raw
    else:  # auto, plain number: 0..1 is a unit score, up to 100 a percentage
        value = raw if 0.0 <= raw <= 1.0 else raw / 100.0
    if not 0.0 <= value <= 1.0:
        raise ScoreParseError(f"score {raw:g} ({source}) is out of range for score_mode {mode!r}")
    if mode == "binary" and value not in (0.0, 1.0):
        raise ScoreParseError(f"score {raw:g} is not 0/1 as score_mode 'binary' requires")
    return value


def _number_form(fragment: str, mode: str, source: str) -> ParsedScore | None:
    """A number written as 85, 85%, 7/10 or 3 out of 4 — exactly one of them."""
    for pattern, kind in ((_PERCENT, "percent"), (_FRACTION, "fraction")):
        match = pattern.search(fragment)
        if match:
            raw = float(match.group(1))
            scale = 100.0 if kind == "percent" else float(match.group(2))
            if scale == 0:
                return None
            return ParsedScore(_normalise(raw, scale, mode, source), raw, source, mode)
    numbers = _ANY_NUMBER.findall(fragment)
    if len(numbers) == 1:
        raw = float(numbers[0])
        return ParsedScore(_normalise(raw, None, mode, source), raw, source, mode)
    if len(numbers) > 1:
        raise ScoreParseError(f"{source} holds several numbers {numbers[:5]}; which is the score?")
    return None


def _yes_no(fragment: str, mode: str, source: str) -> ParsedScore | None:
    match = _VERDICT.match(fragment.strip())
    if match is None:
        return None
    value = 1.0 if match.group(1).lower() in _POSITIVE else 0.0
    return ParsedScore(value, value, source, mode)


def parse_score(text: str, mode: str = "auto", *, finish_reason: str | None = None) -> ParsedScore:
    if mode not in MODES:
        raise ValueError(f"unknown score_mode {mode!r}")
    visible = strip_reasoning(text or "")
    try:
        parsed = _first_match(visible, mode)
    except ScoreParseError as err:
        raise ScoreParseError(err.message, output_text=text) from None
    if parsed is not None:
        return parsed
    if finish_reason == "length":
        raise ScoreParseError("reply was cut at max_tokens (finish_reason=length) before any score",
                              output_text=text)
    raise ScoreParseError("no score found in the model's reply", output_text=text)


def _first_match(visible: str, mode: str) -> ParsedScore | None:
    for source, pattern in _TAGS:
        match = pattern.search(visible)
        if match:
            inner = match.group(1)
            found = _number_form(inner, mode, source) or _yes_no(inner, mode, source)
            if found is None:
                raise ScoreParseError(f"<{source.split('_')[0]}> holds no score: {inner.strip()[:80]!r}")
            return found
    match = _SCORE_MARKER.search(visible)
    if match:
        return _number_form(match.group(1), mode, "score_marker")
    match = _DOUBLE_BRACKET.search(visible)
    if match:
        raw = float(match.group(1))
        return ParsedScore(_normalise(raw, None, mode, "double_bracket"), raw, "double_bracket", mode)
    for pattern, source in ((_PERCENT, "percent"), (_FRACTION, "fraction")):
        if len(pattern.findall(visible)) == 1:
            return _number_form(pattern.search(visible).group(0), mode, source)
    numbers = _ANY_NUMBER.findall(visible)
    if len(numbers) == 1:
        raw = float(numbers[0])
        return ParsedScore(_normalise(raw, None, mode, "bare_number"), raw, "bare_number", mode)
    if len(numbers) > 1:
        raise ScoreParseError(f"several numbers {numbers[:5]} and no tag; the score is ambiguous")
    # An untagged verdict counts only when a verdict was asked for: otherwise "No, I cannot see
    # the video" would become a confident 0.
    return _yes_no(visible, mode, "yes_no") if mode == "binary" else None
