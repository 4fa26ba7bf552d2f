"""A probability answer: the score is P(affirmative token) as the reply's first token, read from
vLLM's logprobs and never from the text. TOPReward's P(done) (arXiv 2602.19313).

The template names two words (`answer: {probability: {affirmative: "True", negative: "False"}}`);
the server's own /tokenize gives their ids (proxy/upstream/answer_tokens.py), and the chat request
asks for `logprob_token_ids` = those ids, `return_tokens_as_token_ids` and max_tokens 1. vLLM
(0.32) then returns the FULL-vocabulary logprob of exactly those tokens at the first generated
position, whatever their rank: `top_logprobs` stops at 20, and an unlikely "True" in a failed
episode is the very case a P(done) must price. The tokens come back as "token_id:<id>", so a
match is by id, never by a decoded string.

The score is P(affirmative), as TOPReward rewards log P("True") and RLinf's port thresholds
exp(log P(" True")); P(negative), the mass on every other token and P(aff) / (P(aff) + P(neg))
are reported beside it. This is teacher forcing of one token: the first token's distribution
after the prompt is the distribution TOPReward reads at the "True" it appends to the prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from proxy.answers.parse import ParsedScore
from proxy.answers.reply import Choice
from proxy.errors import ScoreParseError, UpstreamProtocolError

__all__ = ["AnswerTokens", "read_probability", "token_id_of"]

PROBABILITY_SCALE = "probability"
VLLM_LOGPROB_FLOOR = -9999.0  # vLLM 0.32 writes max(logprob, -9999.0)
SOURCE = "first_token_logprobs"


@dataclass(frozen=True)
class AnswerTokens:
    """The two answer words and their ids in the served model's vocabulary."""

    affirmative: str
    negative: str
    affirmative_id: int
    negative_id: int

    @property
    def ids(self) -> list[int]:
        return [self.affirmative_id, self.negative_id]


def token_id_of(token: Any) -> int | None:
    """The id in vLLM's "token_id:<id>" (return_tokens_as_token_ids), else None."""
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    return None


def _logprob(entry: dict[str, Any], endpoint: str) -> float:
    value = entry.get("logprob")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise UpstreamProtocolError(f"{endpoint}: a logprobs entry without a numeric logprob", endpoint=endpoint)
    return min(float(value), 0.0)


def read_probability(choice: Choice, tokens: AnswerTokens, mode: str, endpoint: str
                     ) -> tuple[ParsedScore, dict[str, Any]]:
    """(the score, what the logprobs said) for the reply's first token."""
    if not choice.logprobs:
        raise ScoreParseError("the reply carries no logprobs for a probability answer (vLLM was asked for the "
                              "answer tokens' logprobs)", output_text=choice.text, finish_reason=choice.finish_reason)
    first = choice.logprobs[0]
    found: dict[int, float] = {}
    for candidate in first.get("top_logprobs") or []:
        token = token_id_of(candidate.get("token")) if isinstance(candidate, dict) else None
        if token in (tokens.affirmative_id, tokens.negative_id):
            found[token] = _logprob(candidate, endpoint)
    missing = [word for word, token in ((tokens.affirmative, tokens.affirmative_id),
                                        (tokens.negative, tokens.negative_id)) if token not in found]
    if missing:
        # vLLM before logprob_token_ids, or a server that ignored it: the answer cannot be priced
        raise UpstreamProtocolError(
            f"{endpoint} returned no logprob for {', '.join(repr(w) for w in missing)} (token ids {tokens.ids}) at the "
            "reply's first token: the server must honour logprob_token_ids (vLLM >= 0.32)", endpoint=endpoint)
    if max(found.values()) <= VLLM_LOGPROB_FLOOR:
        # vLLM clips at -9999: neither word has any probability, so these ids are not this server's words
        # (a replica restarted with another tokenizer under the same name): never a score of 0
        raise UpstreamProtocolError(f"{endpoint}: {tokens.affirmative!r} and {tokens.negative!r} (token ids "
                                    f"{tokens.ids}) both sit at vLLM's logprob floor: the ids do not name this "
                                    "server's words", endpoint=endpoint)
    p_yes, p_no = math.exp(found[tokens.affirmative_id]), math.exp(found[tokens.negative_id])
    if p_yes + p_no > 1.0 + 1e-6:
        raise UpstreamProtocolError(f"{endpoint}: P({tokens.affirmative!r}) + P({tokens.negative!r}) = "
                                    f"{p_yes + p_no:.6f} > 1: not one token's distribution", endpoint=endpoint)
    sampled = token_id_of(first.get("token"))
    info = {
        "p_affirmative": p_yes, "p_negative": p_no, "mass_other": max(0.0, 1.0 - p_yes - p_no),
        "normalised": p_yes / (p_yes + p_no) if p_yes + p_no > 0 else None,
        "affirmative": tokens.affirmative, "negative": tokens.negative, "token_ids": tokens.ids,
        # what the model would have said first: one of the two words, or another token (by id)
        "first_token": (tokens.affirmative if sampled == tokens.affirmative_id else
                        tokens.negative if sampled == tokens.negative_id else first.get("token")),
    }
    return ParsedScore(p_yes, p_yes, SOURCE, PROBABILITY_SCALE, mode), info
