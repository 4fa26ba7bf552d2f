"""From a model's reply to a score in [0, 1], by the answer the prompt template declares.

A template declares its answer (proxy/prompting/templates.py): the tag(s) it asks for (`<answer>`, `<score>`),
whether an untagged answer is acceptable (a template that asks for "only the number"), and its
scale (scales.py). After reasoning is removed — `<think>…</think>` blocks, everything up to an
orphan `</think>` (a template that opens <think> itself), and an unclosed `<think>` to the end —
exactly one declared answer holding one number within the scale is a score:

    <answer>85</answer>, <answer> 85% </answer> (0–100 scales), <answer>7/10</answer> (0–10)
    an untagged reply, when declared: the whole trimmed reply is that one number ("85", "85.")
    a binary scale also takes a verdict: <answer>yes</answer>, "No."

Everything else is a ScoreParseError (unparseable_score) carrying the reply: no tag, two tags,
an unclosed or empty tag, words around the number, a number off the scale, and any reply cut
at max_tokens (finish_reason "length"). A number found elsewhere in the text is never a score.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from proxy.answers.scales import Scale, scale_for_mode
from proxy.errors import ScoreParseError

__all__ = ["AnswerSpec", "ParsedScore", "PerFrame", "declared_fragment", "labelled_fragment", "parse_score",
           "refuse_cut", "strip_reasoning"]

_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
# One number, optionally "%" or "/max", optionally one trailing full stop: nothing else.
_NUMBER_FORM = re.compile(r"\A\s*" + _NUMBER + r"\s*(%|/\s*" + _NUMBER + r")?\s*\.?\s*\Z")
_VERDICT_FORM = re.compile(r"\A\s*([A-Za-z]+)\s*[.!]?\s*\Z")
_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.S | re.I)
_THINK_ORPHAN_CLOSE = re.compile(r"\A.*</think>", re.S | re.I)  # greedy: up to the last one
_THINK_UNCLOSED = re.compile(r"<think>.*\Z", re.S | re.I)


@dataclass(frozen=True)
class PerFrame:
    """A per-frame answer's words (per_frame.py: GVL's one-call progress)."""

    label: str  # "Frame {i}:": the text before the i-th shown image
    reply: str  # "Frame {i}: ... {value}%": one reply line

    def label_of(self, shown: int) -> str:
        return self.label.replace("{i}", str(shown))


@dataclass(frozen=True)
class AnswerSpec:
    """The answer a template asks for."""

    tags: tuple[str, ...]  # e.g. ("answer",); () = an untagged answer only
    untagged: bool  # the whole trimmed reply may be the answer (always True when tags == ())
    scale: Scale
    constrain: bool = False  # ask vLLM to constrain the reply to this format (constraints.py)
    reasoning: bool = False  # the reply opens with a <think>…</think> block (for the constraint)
    # `ANSWER:` (RoboReward): the answer is the rest of the one line that starts with this label
    label: str | None = None
    # (affirmative, negative) answer tokens: the score is P(affirmative) at the reply's first token,
    # read from the logprobs, never from the text (probability.py: TOPReward's P(done))
    probability: tuple[str, str] | None = None
    per_frame: PerFrame | None = None  # one value per shown frame, shuffled (per_frame.py: GVL)

    def describe(self) -> str:
        if self.per_frame:
            return f"one line {self.per_frame.reply!r} per frame, each value on the {self.scale.name} scale"
        if self.probability:
            return f"the probability of {self.probability[0]!r} as the reply's first token"
        if self.label:
            return f"one number on the {self.scale.name} scale after {self.label!r} (the rest of its line)"
        where = " or ".join(f"<{t}>…</{t}>" for t in self.tags) or "the whole reply"
        if self.tags and self.untagged:
            where += " or the whole reply"
        return f"one number on the {self.scale.name} scale in {where}"


@dataclass(frozen=True)
class ParsedScore:
    score: float  # normalised to [0, 1]
    raw_score: float  # as the model wrote it
    source: str  # "answer_tag", "score_tag", ... or "untagged"
    scale: str  # the scale's name, e.g. "0-100"
    mode: str  # the score_mode used


def strip_reasoning(text: str) -> str:
    text = _THINK_BLOCK.sub("", text)
    text = _THINK_ORPHAN_CLOSE.sub("", text)
    return _THINK_UNCLOSED.sub("", text)


def _tag_pattern(tag: str) -> re.Pattern[str]:
    return re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.S | re.I)


def parse_score(text: str, spec: AnswerSpec, mode: str = "auto", *,
                finish_reason: str | None = None) -> ParsedScore:
    scale = scale_for_mode(mode, spec.scale)

    def fail(reason: str) -> ScoreParseError:
        return ScoreParseError(f"{reason}; the template asks for {spec.describe()}",
                               output_text=text, finish_reason=finish_reason)

    if spec.label:
        fragment, source = labelled_fragment(text, spec.label, fail, finish_reason=finish_reason)
    else:
        fragment, source = declared_fragment(text, spec.tags, spec.untagged, fail, what="answer",
                                             finish_reason=finish_reason)
    parsed = _read(fragment, scale, source, mode)
    if parsed is None:
        if source == "untagged":
            raise fail(f"the reply is not one number on the {scale.name} scale")
        where = f"{spec.label!r} is followed by" if source == "label" else f"<{source[:-4]}> holds"
        raise fail(f"{where} {fragment.strip()[:60]!r}, not one number on the {scale.name} scale")
    return parsed


def declared_fragment(text: str, tags: tuple[str, ...], untagged: bool, fail: Callable[[str], Exception], *,
                      what: str, finish_reason: str | None) -> tuple[str, str]:
    """(the text in the one declared place, "<tag>_tag" or "untagged") of a reply after its
    reasoning, or `fail(reason)` raised: a reply cut at max_tokens, two tags, an unclosed one,
    nothing after the reasoning, no tag where one is required. Scores and preference labels read
    replies this one way."""
    refuse_cut(finish_reason, fail)
    visible = strip_reasoning(text or "")
    found = [(tag, inner) for tag in tags for inner in _tag_pattern(tag).findall(visible)]
    if len(found) > 1:
        raise fail(f"{len(found)} {what} tags ({', '.join(f'<{t}>' for t, _ in found)}); which is the {what}?")
    # More openings than closed pairs: a second answer begun and never finished, before or after the
    # closed one (which is then not the one answer the template asked for).
    unclosed = [t for t in tags if len(re.findall(rf"<{re.escape(t)}>", visible, re.I)) > sum(f[0] == t for f in found)]
    if unclosed:
        raise fail(f"<{unclosed[0]}> is never closed")
    if found:
        return found[0][1], f"{found[0][0]}_tag"
    if not visible.strip():
        raise fail(f"the reply holds reasoning and no {what} after it" if (text or "").strip()
                   else "the reply is empty")
    if not untagged:
        raise fail(f"no {what} tag in the reply")
    return visible, "untagged"


def refuse_cut(finish_reason: str | None, fail: Callable[[str], Exception]) -> None:
    """A reply cut at max_tokens holds no answer, whatever it holds: one rule for every answer form."""
    if finish_reason == "length":
        raise fail("the reply was cut at max_tokens (finish_reason=length)")


def labelled_fragment(text: str, label: str, fail: Callable[[str], Exception], *,
                      finish_reason: str | None) -> tuple[str, str]:
    """The rest of the line after the one `label` (e.g. "ANSWER:") in a reply after its reasoning."""
    refuse_cut(finish_reason, fail)
    found = re.findall(re.escape(label) + r"([^\n]*)", strip_reasoning(text or ""))
    if len(found) > 1:
        raise fail(f"{len(found)} lines hold {label!r}; which is the answer?")
    if not found:
        raise fail(f"no {label!r} in the reply")
    return found[0], "label"


def _read(fragment: str, scale: Scale, source: str, mode: str) -> ParsedScore | None:
    """One number (or, binary, a verdict) making up the whole fragment, on the scale."""
    match = _NUMBER_FORM.match(fragment)
    if match:
        raw, suffix, denominator = float(match.group(1)), match.group(2), match.group(3)
        if suffix == "%" and scale.max != 100:
            return None
        if denominator is not None and float(denominator) != scale.max:
            return None
        score = scale.normalise(raw)
        return None if score is None else ParsedScore(score, raw, source, scale.name, mode)
    verdict = _VERDICT_FORM.match(fragment)
    if verdict:
        score = scale.verdict(verdict.group(1))
        if score is not None:
            return ParsedScore(score, score, source, scale.name, mode)
    return None
