"""The /score pipeline: media → prompt → layout → upstream (under the retry policy) → parse.

No FastAPI here: the routes in api.py are thin wrappers around `Scorer.score`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from proxy.backends import Backend, BackendRegistry
from proxy.config import BackendConfig, SamplingConfig, Settings
from proxy.errors import InvalidRequest, ProxyError, ScoreParseError, TokenBudgetExceeded
from proxy.layouts import build_chat_body, estimate_prompt_tokens
from proxy.media import EncodedFrames, FrameLimits, prepare_frames, resolve_media_path
from proxy.observe import AuditLog, Metrics
from proxy.parse import MODES, ParsedScore, parse_score
from proxy.prompts import PromptStore
from proxy.retry import Attempt, call_with_retries
from proxy.schemas import FramesInfo, ParseInfo, PromptInfo, ScoreRequest, ScoreResponse, validation_error
from proxy.upstream import ChatReply, UpstreamClient

log = logging.getLogger(__name__)
SAMPLING_FIELDS = frozenset(SamplingConfig.model_fields)


@dataclass(frozen=True)
class _Resolved:
    """A request's effective settings after defaults, caps and backend_kwargs."""

    sampling: SamplingConfig
    score_mode: str
    variables: dict[str, Any]
    limits: FrameLimits


class Scorer:
    def __init__(self, settings: Settings, registry: BackendRegistry, prompts: PromptStore,
                 upstream: UpstreamClient, metrics: Metrics, audit: AuditLog) -> None:
        self.settings = settings
        self.registry = registry
        self.prompts = prompts
        self.upstream = upstream
        self.metrics = metrics
        self.audit = audit

    async def score(self, request: ScoreRequest, *, admit: bool = True) -> ScoreResponse:
        """Score one episode. `admit=False` skips the queue-full check (batch items were
        admitted as a whole); they still wait for endpoint slots like everyone else."""
        started = time.perf_counter()
        backend = self.registry.resolve(request.backend)
        labels = {"backend": backend.name}
        self.metrics.in_flight.labels(**labels).inc()
        try:
            if admit:
                backend.pool.check_admission()
            response = await self._score(request, backend, started)
        except ProxyError as err:
            self.metrics.requests.labels(route="score", outcome=err.code, **labels).inc()
            self.audit.write({"backend": backend.name, "task_text": request.task_text,
                              "error": err.code, "message": err.message, "attempts": err.attempts})
            raise
        finally:
            self.metrics.in_flight.labels(**labels).dec()
        self.metrics.requests.labels(route="score", outcome="ok", **labels).inc()
        self.metrics.scores.labels(**labels).observe(response.score)
        self.metrics.latency.labels(**labels).observe(response.timings_ms["total"] / 1e3)
        self.audit.write(_audit_record(request, response))
        return response

    async def _score(self, request: ScoreRequest, backend: Backend, started: float) -> ScoreResponse:
        cfg = backend.config
        template = self.prompts.get(cfg.prompt)
        resolved = self._resolve(request, cfg, template.variable_names)
        system, user_text = template.render({"task_text": request.task_text, **resolved.variables})

        frames = await asyncio.to_thread(self._load_frames, request, resolved.limits)
        self.metrics.stage.labels(stage="load").observe(frames.load_ms / 1e3)
        self.metrics.stage.labels(stage="encode").observe(frames.encode_ms / 1e3)
        self._check_token_budget(cfg, resolved.sampling, frames, len(user_text) + len(system or ""))

        body = build_chat_body(cfg, resolved.sampling, system, user_text, frames)
        body_bytes = json.dumps(body, separators=(",", ":")).encode()
        upstream_started = time.perf_counter()

        sent_sampling = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}

        async def send(attempt: Attempt) -> ChatReply:
            payload = body_bytes
            if attempt.parse_round > 0 and cfg.retry.parse_retry_temperature is not None:
                payload = json.dumps({**body, "temperature": cfg.retry.parse_retry_temperature},
                                     separators=(",", ":")).encode()
                sent_sampling["temperature"] = cfg.retry.parse_retry_temperature  # what the reply had
            return await backend.call(attempt.avoid, self.metrics, lambda endpoint: self.upstream.chat(
                endpoint, payload, timeout_s=attempt.timeout_s, api_key=cfg.api_key()))

        def parse(reply: ChatReply) -> ParsedScore:
            try:
                return parse_score(reply.text, resolved.score_mode, finish_reason=reply.finish_reason)
            except ScoreParseError:
                self.metrics.parse_failures.labels(backend.name).inc()
                raise

        reply, parsed, calls = await call_with_retries(cfg.retry, send, parse)
        finished = time.perf_counter()
        self.metrics.stage.labels(stage="upstream").observe(finished - upstream_started)
        return ScoreResponse(
            score=parsed.score, raw_score=parsed.raw_score, backend=backend.name,
            model=reply.model or cfg.model, output_text=reply.text,
            parse=ParseInfo(mode=parsed.mode, source=parsed.source, finish_reason=reply.finish_reason),
            attempts=calls, prompt=PromptInfo(name=template.name, sha256=template.sha256),
            frames=FramesInfo(count=len(frames.jpegs), indices=frames.indices,
                              source_count=frames.source_count, size=(frames.width, frames.height),
                              sampled_fps=round(frames.sampled_fps, 6), sha256=frames.sha256),
            sampling=sent_sampling,
            endpoint=reply.endpoint,
            timings_ms={"load": round(frames.load_ms, 3), "encode": round(frames.encode_ms, 3),
                        "upstream": round((finished - upstream_started) * 1e3, 3),
                        "total": round((finished - started) * 1e3, 3)},
        )

    async def score_batch(self, items: list[Any]) -> list[dict[str, Any]]:
        """Every item scored concurrently; each gets its own result or its own error, in order."""

        async def one(index: int, item: Any) -> dict[str, Any]:
            try:
                request = ScoreRequest.model_validate(item)
                result = await self.score(request, admit=False)
            except ValidationError as err:
                failure: ProxyError = validation_error(err.errors())
            except ProxyError as err:
                failure = err
            except Exception as err:  # noqa: BLE001 - one broken item must not sink the batch
                log.exception("batch item %d failed unexpectedly", index)
                failure = ProxyError(f"internal error: {type(err).__name__}")
            else:
                return {"index": index, "ok": True, "status": 200, "result": result.model_dump(mode="json")}
            return {"index": index, "ok": False, "status": failure.status_code, "error": failure.to_dict()}

        return list(await asyncio.gather(*(one(i, item) for i, item in enumerate(items))))

    def _resolve(self, request: ScoreRequest, cfg: BackendConfig, template_vars: set[str]) -> _Resolved:
        proxy = self.settings.proxy
        nframes = request.nframes or cfg.frames.nframes
        if nframes > proxy.max_nframes:
            raise InvalidRequest(f"nframes {nframes} is over the cap of {proxy.max_nframes}",
                                 field="nframes")
        if cfg.layout == "images" and nframes > cfg.frames.nframes:
            # One image part per frame: the server's --limit-mm-per-prompt image count is frames.nframes.
            raise InvalidRequest(f"backend uses the images layout, one image per frame; its servers take at most "
                                 f"frames.nframes={cfg.frames.nframes} images (--limit-mm-per-prompt)",
                                 field="nframes")
        max_pixels = request.max_pixels or cfg.frames.max_pixels
        if not cfg.frames.min_pixels <= max_pixels <= proxy.max_pixels_limit:
            raise InvalidRequest(f"max_pixels must be within [{cfg.frames.min_pixels}, "
                                 f"{proxy.max_pixels_limit}], got {max_pixels}", field="max_pixels")
        overrides, variables, score_mode = {}, {}, cfg.score_mode
        for key, value in request.backend_kwargs.items():
            if key in SAMPLING_FIELDS:
                overrides[key] = value
            elif key == "score_mode":
                if value not in MODES:
                    raise InvalidRequest(f"score_mode must be one of {', '.join(MODES)}",
                                         field="backend_kwargs.score_mode")
                score_mode = value
            elif key in template_vars and key != "task_text":
                variables[key] = value
            else:
                raise InvalidRequest(
                    f"backend_kwargs.{key} is not a sampling field ({', '.join(sorted(SAMPLING_FIELDS))}), "
                    f"score_mode, or a variable of prompt {cfg.prompt!r} "
                    f"({', '.join(sorted(template_vars - {'task_text'})) or 'none'})",
                    field=f"backend_kwargs.{key}")
        sampling = _override_sampling(cfg, overrides)
        limits = FrameLimits(
            nframes=nframes, max_pixels=max_pixels, min_pixels=cfg.frames.min_pixels,
            jpeg_quality=cfg.frames.jpeg_quality, default_source_fps=cfg.frames.default_source_fps,
            max_inline_frames=proxy.max_inline_frames, max_source_pixels=proxy.max_source_pixels)
        return _Resolved(sampling=sampling, score_mode=score_mode, variables=variables, limits=limits)

    def _load_frames(self, request: ScoreRequest, limits: FrameLimits) -> EncodedFrames:
        video_path: Path | None = None
        if request.video_path is not None:
            video_path = resolve_media_path(request.video_path, self.settings.proxy.allowed_media_roots)
        return prepare_frames(limits, video_path=video_path, frames=request.frames,
                              frames_npy=request.frames_npy, fps=request.fps)

    @staticmethod
    def _check_token_budget(cfg: BackendConfig, sampling: SamplingConfig, frames: EncodedFrames,
                            text_chars: int) -> None:
        if cfg.max_model_len is None:
            return
        needed = estimate_prompt_tokens(cfg.layout, frames, text_chars) + sampling.max_tokens
        if needed > cfg.max_model_len:
            raise TokenBudgetExceeded(
                f"{len(frames.jpegs)} frames at {frames.width}x{frames.height} need about {needed} "
                f"tokens with max_tokens {sampling.max_tokens}, over max_model_len "
                f"{cfg.max_model_len}; lower nframes or max_pixels", field="nframes")


def _override_sampling(cfg: BackendConfig, overrides: dict[str, Any]) -> SamplingConfig:
    if not overrides:
        return cfg.sampling
    try:
        sampling = SamplingConfig.model_validate({**cfg.sampling.model_dump(), **overrides})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"backend_kwargs.{key}: {first['msg']}", field=f"backend_kwargs.{key}") from None
    if sampling.max_tokens > cfg.max_tokens_limit:
        raise InvalidRequest(f"backend_kwargs.max_tokens is over the cap of {cfg.max_tokens_limit}",
                             field="backend_kwargs.max_tokens")
    return sampling


def _audit_record(request: ScoreRequest, response: ScoreResponse) -> dict[str, Any]:
    """Everything needed to reproduce a reward, and no media (hashes stand in for frames)."""
    return {
        "backend": response.backend, "model": response.model, "task_text": request.task_text,
        "score": response.score, "raw_score": response.raw_score, "parse": response.parse.model_dump(),
        "attempts": response.attempts, "prompt": response.prompt.model_dump(),
        "frames": {"indices": response.frames.indices, "size": response.frames.size,
                   "sha256": response.frames.sha256},
        "sampling": response.sampling, "endpoint": response.endpoint, "output_text": response.output_text,
        "timings_ms": response.timings_ms,
    }

