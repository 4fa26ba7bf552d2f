"""How a reply becomes one score: the answer of one sample, a reduction over k samples, or the
expectation over the answer token's probabilities. One layer over parse.py, used for every ask.

k samples (`samples: k`) come from one request with vLLM's `n = k` (one prefill, k decodes).
Each sample is parsed on its own; those that fail are counted and kept in the provenance, and the
episode fails (unparseable_score, re-asked like any other) only when fewer than `quorum` parse.
The reduction is over normalised scores:

    median    the middle score (the mean of the two middle ones for an even count)
    mean      the average
    majority  the most frequent raw answer (ties: the median of the tied answers)

and the spread reports std, min, max and the share of samples that agree with the result.

The logprob score (`logprob_score: true`) reads the top_logprobs at the answer's first token and
takes the expectation over the scale values found there, normalised by their mass; the mass on
other tokens is reported. It needs a single-token scale (0-9, or binary): Qwen2.5's tokenizer
splits numbers into single digits, so "85" is two tokens and the expectation over a 0-100 scale
would need the joint distribution of both — use samples for those scales.

A probability answer (TOPReward's P(done)) is no estimate over parsed values: its score IS a
probability, read in probability.py.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

from proxy.answers.parse import AnswerSpec, ParsedScore, parse_score, strip_reasoning
from proxy.answers.per_frame import Shuffle, parse_per_frame
from proxy.answers.probability import AnswerTokens, read_probability
from proxy.answers.reply import ChatReply, Choice
from proxy.errors import ScoreParseError, UpstreamProtocolError

__all__ = ["REDUCTIONS", "Estimate", "Estimated", "estimate", "single_token_values"]

REDUCTIONS = ("median", "mean", "majority")


@dataclass(frozen=True)
class Estimate:
    """How a request's score is estimated (resolved from the backend config and backend_kwargs)."""

    samples: int = 1
    reduce: str = "median"
    quorum: int = 1
    logprob: bool = False
    constrain: bool = False


@dataclass(frozen=True)
class Estimated:
    parsed: ParsedScore  # the score (reduced or expected) as one parsed answer
    samples: list[dict[str, Any]] | None = None  # every sample, parsed or not (k > 1)
    spread: dict[str, float] | None = None
    logprob: dict[str, Any] | None = None
    probability: dict[str, Any] | None = None  # a probability answer's P(affirmative), P(negative), ...
    per_frame: list[ParsedScore] | None = None  # a per-frame answer's values, in time order (last = the score)


def single_token_values(spec: AnswerSpec) -> dict[str, float] | None:
    """Token text → raw value for a scale whose every value is one token, else None."""
    scale = spec.scale
    if scale.binary:
        return {"yes": 1.0, "no": 0.0, "1": 1.0, "0": 0.0}  # the parser takes 0/1 on a binary scale too
    # 0-1 is a continuous scale (0.75 is three tokens): only integer scales up to 9 are one token each
    if scale.min >= 0 and 1 < scale.max <= 9 and scale.min == int(scale.min) and scale.max == int(scale.max):
        return {str(v): float(v) for v in range(int(scale.min), int(scale.max) + 1)}
    return None


def estimate(reply: ChatReply, spec: AnswerSpec, mode: str, how: Estimate,
             tokens: AnswerTokens | None = None, shuffle: Shuffle | None = None) -> Estimated:
    """`tokens`: a probability answer's two words as the replying server numbers them; `shuffle`: a
    per-frame answer's shown order (its score is the last frame's value)."""
    if len(reply.choices) != how.samples:  # a server that ignores n must not shrink the quorum's base
        raise UpstreamProtocolError(f"{reply.endpoint} answered {len(reply.choices)} choices for n={how.samples}",
                                    endpoint=reply.endpoint)
    if spec.probability:
        if tokens is None:
            raise ValueError("a probability answer is read with its answer tokens' ids")
        parsed, info = read_probability(reply.choices[0], tokens, mode, reply.endpoint)
        return Estimated(parsed, probability=info)
    if spec.per_frame:
        if shuffle is None:
            raise ValueError("a per-frame answer is read with the order its frames were shown in")
        in_time, _ = parse_per_frame(reply.text, spec, shuffle, finish_reason=reply.finish_reason)
        return Estimated(in_time[-1], per_frame=in_time)
    if how.samples > 1:
        return _reduce(reply.choices, spec, mode, how)
    choice = reply.choices[0]
    parsed = parse_score(choice.text, spec, mode, finish_reason=choice.finish_reason)
    if not how.logprob:
        return Estimated(parsed)
    return _expectation(choice, spec, parsed)


def _reduce(choices: tuple[Choice, ...], spec: AnswerSpec, mode: str, how: Estimate) -> Estimated:
    samples, parsed, first_error = [], [], None
    for index, choice in enumerate(choices):
        try:
            one = parse_score(choice.text, spec, mode, finish_reason=choice.finish_reason)
        except ScoreParseError as err:
            first_error = first_error or err
            samples.append({"index": index, "ok": False, "error": err.message, "finish_reason": choice.finish_reason,
                            "output_text": choice.text[:2000]})
            continue
        parsed.append(one)
        samples.append({"index": index, "ok": True, "score": one.score, "raw_score": one.raw_score,
                        "finish_reason": choice.finish_reason, "output_text": choice.text[:2000]})
    if len(parsed) < how.quorum:
        raise ScoreParseError(
            f"{len(parsed)} of {len(choices)} samples hold the declared answer, fewer than the quorum of "
            f"{how.quorum}" + (f"; the first failure: {first_error.message}" if first_error else ""),
            output_text=choices[0].text, finish_reason=choices[0].finish_reason)
    scores = [p.score for p in parsed]
    if spec.scale.binary and 2 * sum(scores) == len(scores):
        # as many yes as no: a 0.5 would pass a >= 0.5 success threshold without a majority
        raise ScoreParseError(f"the {len(scores)} parsed samples split evenly between yes and no: no verdict "
                              "(an odd samples count avoids most ties)",
                              output_text=choices[0].text, finish_reason=choices[0].finish_reason)
    if how.reduce == "mean":
        score = statistics.fmean(scores)
    elif how.reduce == "majority":
        counts = Counter(p.raw_score for p in parsed)
        top = max(counts.values())
        score = statistics.median(p.score for p in parsed if counts[p.raw_score] == top)
    else:
        score = statistics.median(scores)
    raw = score * (spec.scale.max - spec.scale.zero) + spec.scale.zero if not spec.scale.binary else score
    spread = {"std": statistics.pstdev(scores), "min": min(scores), "max": max(scores),
              "agree": sum(math.isclose(s, score) for s in scores) / len(scores),
              "parsed": len(parsed), "samples": len(choices)}
    first = parsed[0]
    return Estimated(ParsedScore(score, raw, first.source, first.scale, first.mode), samples, spread)


def _answer_offset(text: str, spec: AnswerSpec) -> int:
    """Where the answer's value starts in the reply (after any reasoning)."""
    visible_from = len(text) - len(strip_reasoning(text))
    if spec.label:
        at = text.rfind(spec.label)
        if at >= visible_from:
            rest = text[at + len(spec.label):]
            return at + len(spec.label) + len(rest) - len(rest.lstrip())
    for tag in spec.tags:
        matches = list(re.finditer(rf"<{re.escape(tag)}>\s*", text[visible_from:], re.I))
        if matches:
            return visible_from + matches[-1].end()
    rest = text[visible_from:]
    return visible_from + len(rest) - len(rest.lstrip())


def _expectation(choice: Choice, spec: AnswerSpec, parsed: ParsedScore) -> Estimated:
    values = single_token_values(spec)
    if values is None or not choice.logprobs:
        raise ScoreParseError("the reply carries no logprobs for a logprob score (vLLM was asked for them)",
                              output_text=choice.text, finish_reason=choice.finish_reason)
    offset, position = _answer_offset(choice.text, spec), 0
    for entry in choice.logprobs:
        token = str(entry.get("token", ""))
        if position + len(token) > offset and token.strip():
            break
        position += len(token)
    else:
        raise ScoreParseError("the answer's token was not found in the reply's logprobs",
                              output_text=choice.text, finish_reason=choice.finish_reason)
    chosen = values.get(token.strip().lower())
    if chosen is None or not math.isclose(chosen, parsed.raw_score):
        # the token strings did not add up to the reply's text (e.g. bytes of a split character
        # come back as U+FFFD): the token found is not the answer's, and its top_logprobs are not
        # the answer's distribution
        raise ScoreParseError(f"the logprobs do not line up with the reply: the token at the answer is {token!r}, "
                              f"the answer is {parsed.raw_score:g}", output_text=choice.text,
                              finish_reason=choice.finish_reason)
    mass: dict[float, float] = {}
    for candidate in entry.get("top_logprobs") or []:
        logprob = candidate.get("logprob") if isinstance(candidate, dict) else None
        if isinstance(logprob, bool) or not isinstance(logprob, int | float):
            raise UpstreamProtocolError("a top_logprobs entry without a numeric logprob")
        value = values.get(str(candidate.get("token", "")).strip().lower())
        if value is not None:
            mass[value] = mass.get(value, 0.0) + math.exp(min(float(logprob), 0.0))
    on_scale = sum(mass.values())
    if on_scale <= 0:
        raise ScoreParseError("no scale value among the answer token's top_logprobs",
                              output_text=choice.text, finish_reason=choice.finish_reason)
    raw = sum(v * p for v, p in mass.items()) / on_scale
    score = spec.scale.normalise(raw) if not spec.scale.binary else raw
    info = {"expected_raw": raw, "mass_on_scale": min(on_scale, 1.0), "mass_outside": max(0.0, 1.0 - on_scale),
            "distribution": {f"{v:g}": p / on_scale for v, p in sorted(mass.items())},
            "greedy_raw": parsed.raw_score}
    return Estimated(ParsedScore(score, raw, parsed.source + "+logprobs", parsed.scale, parsed.mode), logprob=info)
