"""One episode → one embedding vector from an embedding backend's `/v1/embeddings`.

The frames are sampled, sized and stored exactly as for /score (`Scorer.load_episode`); the
call goes through the backend's pool, retry policy, admission and circuit like a chat call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.answers.reply import EmbeddingReply
from proxy.errors import InvalidRequest
from proxy.media.decode import FrameLimits
from proxy.media.views import check_views
from proxy.pipelines.scoring import Scorer
from proxy.prompting.layouts import build_embedding_body, encode_body
from proxy.prompting.request import frame_limits
from proxy.protocol.progress import EmbeddingInfo
from proxy.protocol.score import ScoreRequest
from proxy.upstream.backends import Backend
from proxy.upstream.retry import Attempt, call_with_retries

__all__ = ["Embedded", "Embedder"]


@dataclass(frozen=True)
class Embedded:
    vector: np.ndarray
    info: EmbeddingInfo
    frame_store: dict[str, Any] | None  # what the frame store did with the episode's JPEGs


class Embedder:
    def __init__(self, scorer: Scorer) -> None:
        self.scorer = scorer

    def check(self, request: ScoreRequest, backend: Backend, where: str | None = None) -> tuple[FrameLimits, int]:
        """The request's frame limits, or a 422 naming the field within `where` (`items[3]`): run on
        every item before any is embedded."""
        try:
            if request.backend_kwargs:
                raise InvalidRequest("an embedding backend takes no backend_kwargs (nothing is sampled)",
                                     field="backend_kwargs")
            # a second camera the backend does not place (or one it needs, missing): the whole request's 422
            check_views(backend.config.frames.extra_view, given=request.extra_view is not None,
                        frame_rules=request.frame_rules is not None)
            return frame_limits(request, backend.config, self.scorer.settings.proxy)
        except InvalidRequest as err:
            if where:
                err.within(where)  # renamed in place: the traceback and cause stay
            raise

    async def embed(self, request: ScoreRequest, backend: Backend, *, budget_s: float | None) -> Embedded:
        cfg, scorer = backend.config, self.scorer
        started = time.perf_counter()
        limits, requested = self.check(request, backend)
        frames, fps, info, stored = await scorer.load_episode(request, cfg, limits, requested)
        system, text = None, None
        if cfg.prompt is not None:
            system, text = scorer.prompts.get(cfg.prompt).render({"task_text": request.task_text})
        body = encode_body(build_embedding_body(cfg, system, text, frames, fps))
        upstream_started = time.perf_counter()

        async def send(attempt: Attempt) -> EmbeddingReply:
            return await backend.call(attempt, scorer.metrics, lambda endpoint: scorer.upstream.embed(
                endpoint, body, timeout_s=attempt.timeout_s, api_key=cfg.api_key()))

        reply, _, calls = await call_with_retries(cfg.retry, send, lambda reply: reply, budget_s=budget_s)
        finished = time.perf_counter()
        scorer.metrics.stage.labels(stage="upstream").observe(finished - upstream_started)
        if isinstance((reply.usage or {}).get("prompt_tokens"), int):
            scorer.metrics.tokens.labels(backend.name, "prompt_tokens").inc(reply.usage["prompt_tokens"])
        return Embedded(np.asarray(reply.vector, dtype=np.float64), EmbeddingInfo(
            model=reply.model or cfg.model, endpoint=reply.endpoint, dim=len(reply.vector), attempts=calls,
            usage=reply.usage, frames=info,
            timings_ms={"load": round(frames.load_ms, 3), "encode": round(frames.encode_ms, 3),
                        "upstream": round((finished - upstream_started) * 1e3, 3),
                        "total": round((finished - started) * 1e3, 3)}), stored)
