"""A model's reply as plain data: the choices of one chat completion, or one embedding. Built by
the upstream client from vLLM's answer; read by the pure code that turns it into a score."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ChatReply", "Choice", "EmbeddingReply"]


@dataclass(frozen=True)
class Choice:
    text: str
    finish_reason: str | None
    # vLLM's `logprobs.content`: [{token, logprob, top_logprobs: [{token, logprob}]}], when asked
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ChatReply:
    """One chat completion: every choice (n samples), the first one's text and finish reason."""

    choices: tuple[Choice, ...]
    model: str | None
    usage: dict[str, Any] | None
    endpoint: str

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


@dataclass(frozen=True)
class EmbeddingReply:
    """One /embeddings answer: the episode's vector as the server computed it."""

    vector: tuple[float, ...]
    model: str | None
    usage: dict[str, Any] | None
    endpoint: str
