"""One episode → one embedding vector from an embedding backend's `/v1/embeddings`.

The frames are sampled, sized and stored exactly as for /score (proxy/pipelines/episode_frames.py);
the call goes through the backend's `ask`, like a chat call: its pool, retry policy and circuits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.errors import InvalidRequest
from proxy.media.decode import FrameLimits
from proxy.media.views import check_views
from proxy.pipelines.episode_frames import load_episode
from proxy.pipelines.services import Services
from proxy.prompting.layouts import build_embedding_body, encode_body
from proxy.prompting.request import frame_limits
from proxy.protocol.progress import EmbeddingInfo
from proxy.protocol.score import ScoreRequest
from proxy.upstream.backends import Backend

__all__ = ["Embedded", "Embedder"]


@dataclass(frozen=True)
class Embedded:
    vector: np.ndarray
    info: EmbeddingInfo
    frame_store: dict[str, Any] | None  # what the frame store did with the episode's JPEGs


class Embedder:
    def __init__(self, services: Services) -> None:
        self.services = services

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
            return frame_limits(request, backend.config, self.services.settings.proxy)
        except InvalidRequest as err:
            if where:
                err.within(where)  # renamed in place: the traceback and cause stay
            raise

    async def embed(self, request: ScoreRequest, backend: Backend, *, budget_s: float | None) -> Embedded:
        cfg, services = backend.config, self.services
        started = time.perf_counter()
        limits, requested = self.check(request, backend)
        loaded = await load_episode(services, request, cfg, limits, requested)
        system, text = None, None
        if cfg.prompt is not None:
            system, text = services.prompts.get(cfg.prompt).render({"task_text": request.task_text})
        body = encode_body(build_embedding_body(cfg, system, text, loaded.frames, loaded.fps))
        upstream_started = time.perf_counter()

        reply, _, calls = await backend.ask(services.metrics, services.upstream.embed, body, budget_s=budget_s)
        finished = time.perf_counter()
        services.metrics.stage.labels(stage="upstream").observe(finished - upstream_started)
        if isinstance((reply.usage or {}).get("prompt_tokens"), int):
            services.metrics.tokens.labels(backend.name, "prompt_tokens").inc(reply.usage["prompt_tokens"])
        frames = loaded.frames
        return Embedded(np.asarray(reply.vector, dtype=np.float64), EmbeddingInfo(
            model=reply.model or cfg.model, endpoint=reply.endpoint, dim=len(reply.vector), attempts=calls,
            usage=reply.usage, frames=loaded.info,
            timings_ms={"load": round(frames.load_ms, 3), "encode": round(frames.encode_ms, 3),
                        "upstream": round((finished - upstream_started) * 1e3, 3),
                        "total": round((finished - started) * 1e3, 3)}), loaded.stored)
