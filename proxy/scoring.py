"""The /score pipeline: media → prompt → layout → upstream (under the retry policy) → parse.

No FastAPI here: the routes are thin wrappers around `Scorer.score`. Every episode, scored or
failed, leaves one audit line with what is needed to reproduce it (prompt hash, frame hashes,
sampling, attempts, the model's last reply) — never media.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from proxy.backends import Backend, BackendRegistry
from proxy.config import BackendConfig, SamplingConfig, Settings
from proxy.errors import MAX_REPLY_CHARS, InvalidRequest, ProxyError, ScoreParseError, TokenBudgetExceeded
from proxy.layouts import build_chat_body, estimate_prompt_tokens, layout_has_stills, vision_token_count
from proxy.media import EncodedFrames, FrameLimits, prepare_frames, resolve_media_path
from proxy.observe import AuditLog, Metrics
from proxy.parse import ParsedScore, parse_score
from proxy.prompts import SEED_PROMPT_KWARGS, PromptStore, PromptTemplate, apply_seed_overrides
from proxy.retry import Attempt, call_with_retries
from proxy.scales import SCORE_MODES
from proxy.schemas import FramesInfo, ParseInfo, PromptInfo, ScoreRequest, ScoreResponse, validation_error
from proxy.upstream import ChatReply, UpstreamClient

log = logging.getLogger(__name__)
SAMPLING_FIELDS = frozenset(SamplingConfig.model_fields)
MIN_MAX_PIXELS = 28 * 28  # the smallest per-frame budget a request may ask for (the seed's bound)


@dataclass(frozen=True)
class _Resolved:
    """A request's effective settings after defaults, caps and backend_kwargs."""

    sampling: SamplingConfig
    score_mode: str
    variables: dict[str, Any]
    prompt_overrides: dict[str, str]  # the seed's system_prompt / user_prompt / prompt_template
    limits: FrameLimits
    requested_nframes: int


@dataclass
class _Trace:
    """What one episode went through so far: the audit line of a success and of a failure."""

    backend: str
    task_text: str
    metadata: dict[str, Any] | None = None
    prompt: PromptInfo | None = None
    frames: FramesInfo | None = None
    sampling: dict[str, Any] | None = None  # of the last ask sent
    asks: int = 0
    last_reply: ChatReply | None = None
    usage_all_calls: dict[str, int] = field(default_factory=dict)

    def saw(self, reply: ChatReply) -> None:
        self.last_reply = reply
        for key, value in (reply.usage or {}).items():
            if isinstance(value, int):
                self.usage_all_calls[key] = self.usage_all_calls.get(key, 0) + value

    def record(self) -> dict[str, Any]:
        reply = self.last_reply
        return {
            "backend": self.backend, "task_text": self.task_text, "metadata": self.metadata,
            "prompt": self.prompt.model_dump() if self.prompt else None,
            "frames": (self.frames.model_dump(include={"count", "requested", "indices", "size", "still_size", "fps",
                                                       "vision_tokens", "sha256"}) if self.frames else None),
            "sampling": self.sampling, "asks": self.asks,
            "output_text": reply.text[:MAX_REPLY_CHARS] if reply else None,
            "finish_reason": reply.finish_reason if reply else None,
            "endpoint": reply.endpoint if reply else None,
            "usage": reply.usage if reply else None, "usage_all_calls": self.usage_all_calls or None,
        }


class Scorer:
    def __init__(self, settings: Settings, registry: BackendRegistry, prompts: PromptStore,
                 upstream: UpstreamClient, metrics: Metrics, audit: AuditLog) -> None:
        self.settings = settings
        self.registry = registry
        self.prompts = prompts
        self.upstream = upstream
        self.metrics = metrics
        self.audit = audit

    async def score(self, request: ScoreRequest, *, admit: bool = True,
                    budget_s: float | None = None) -> ScoreResponse:
        """Score one episode. `admit=False` skips the queue-full check (batch items were
        admitted as a whole); they still wait for endpoint slots like everyone else.
        `budget_s`: how long the caller will wait (its deadline caps the retry policy's)."""
        started = time.perf_counter()
        try:
            backend = self.registry.resolve(request.backend)
        except ProxyError as err:
            self.metrics.episodes.labels("none", err.code).inc()
            raise
        trace = _Trace(backend=backend.name, task_text=request.task_text,
                       metadata=request.metadata.model_dump(exclude_none=True) if request.metadata else None)
        self.metrics.in_flight.labels(backend.name).inc()
        try:
            if admit:
                backend.pool.check_admission()
            response = await self._score(request, backend, started, budget_s, trace)
        except ProxyError as err:
            err.backend = backend.name  # the true label for the HTTP request counter
            self.metrics.episodes.labels(backend.name, err.code).inc()
            self.audit.write({**trace.record(), "error": {"code": err.code, "message": err.message},
                              "attempts": err.attempts})
            raise
        finally:
            self.metrics.in_flight.labels(backend.name).dec()
        self.metrics.episodes.labels(backend.name, "ok").inc()
        self.metrics.scores.labels(backend.name).observe(response.score)
        self.metrics.latency.labels(backend.name).observe(response.timings_ms["total"] / 1e3)
        self.audit.write({**trace.record(), "model": response.model, "score": response.score,
                          "raw_score": response.raw_score, "parse": response.parse.model_dump(),
                          "attempts": response.attempts, "timings_ms": response.timings_ms})
        return response

    async def _score(self, request: ScoreRequest, backend: Backend, started: float,
                     budget_s: float | None, trace: _Trace) -> ScoreResponse:
        cfg = backend.config
        template = self.prompts.get(cfg.prompt)
        resolved = self._resolve(request, cfg, template)
        trace.prompt = PromptInfo(name=template.name, sha256=template.sha256, overrides={
            key: hashlib.sha256(text.encode()).hexdigest() for key, text in resolved.prompt_overrides.items()})
        system, user_text = template.render({"task_text": request.task_text, **resolved.variables})
        system, user_text = apply_seed_overrides(system, user_text, request.task_text, resolved.prompt_overrides)

        frames = await asyncio.to_thread(self._load_frames, request, resolved.limits)
        fps = _presentation_fps(cfg, request, frames)
        trace.frames = FramesInfo(
            count=len(frames.jpegs), requested=resolved.requested_nframes, indices=frames.indices,
            source_count=frames.source_count, size=(frames.width, frames.height), still_size=frames.still_size,
            fps=round(fps, 6), sampled_fps=round(frames.sampled_fps, 6),
            vision_tokens=vision_token_count(cfg.layout, frames), sha256=frames.sha256)
        self.metrics.stage.labels(stage="load").observe(frames.load_ms / 1e3)
        self.metrics.stage.labels(stage="encode").observe(frames.encode_ms / 1e3)
        self._check_token_budget(cfg, resolved.sampling, frames, len(user_text) + len(system or ""))

        body = build_chat_body(cfg, resolved.sampling, system, user_text, frames, fps)
        first_ask = json.dumps(body, separators=(",", ":")).encode()
        upstream_started = time.perf_counter()

        async def send(attempt: Attempt) -> ChatReply:
            sampling = _sampling_for_ask(cfg, resolved.sampling, attempt.parse_round)
            payload = first_ask if attempt.parse_round == 0 else json.dumps(
                {**body, **sampling}, separators=(",", ":")).encode()
            trace.sampling, trace.asks = sampling, attempt.parse_round + 1
            return await backend.call(attempt, self.metrics, lambda endpoint: self.upstream.chat(
                endpoint, payload, timeout_s=attempt.timeout_s, api_key=cfg.api_key()))

        def seen(reply: ChatReply) -> None:
            trace.saw(reply)
            self.metrics.replies.labels(backend.name, reply.finish_reason or "unknown").inc()
            for kind in ("prompt_tokens", "completion_tokens"):
                if isinstance((reply.usage or {}).get(kind), int):
                    self.metrics.tokens.labels(backend.name, kind).inc(reply.usage[kind])

        def parse(reply: ChatReply) -> ParsedScore:
            try:
                return parse_score(reply.text, template.answer, resolved.score_mode,
                                   finish_reason=reply.finish_reason)
            except ScoreParseError:
                self.metrics.parse_failures.labels(backend.name).inc()
                raise

        reply, parsed, calls = await call_with_retries(cfg.retry, send, parse, budget_s=budget_s,
                                                       on_reply=seen)
        finished = time.perf_counter()
        self.metrics.stage.labels(stage="upstream").observe(finished - upstream_started)
        return ScoreResponse(
            score=parsed.score, raw_score=parsed.raw_score, backend=backend.name,
            model=reply.model or cfg.model, output_text=reply.text,
            parse=ParseInfo(mode=parsed.mode, scale=parsed.scale, source=parsed.source,
                            finish_reason=reply.finish_reason),
            attempts=calls, asks=trace.asks, prompt=trace.prompt, frames=trace.frames,
            sampling=trace.sampling or {}, usage=reply.usage, endpoint=reply.endpoint,
            timings_ms={"load": round(frames.load_ms, 3), "encode": round(frames.encode_ms, 3),
                        "upstream": round((finished - upstream_started) * 1e3, 3),
                        "total": round((finished - started) * 1e3, 3)},
        )

    async def score_batch(self, items: list[Any], *, budget_s: float | None = None) -> list[dict[str, Any]]:
        """Every item scored concurrently; each gets its own result or its own error, in order."""

        async def one(index: int, item: Any) -> dict[str, Any]:
            try:
                request = ScoreRequest.model_validate(item)
                result = await self.score(request, admit=False, budget_s=budget_s)
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

    def _resolve(self, request: ScoreRequest, cfg: BackendConfig, template: PromptTemplate) -> _Resolved:
        proxy = self.settings.proxy
        requested = request.nframes or cfg.frames.nframes
        if requested > proxy.max_nframes:
            raise InvalidRequest(f"nframes {requested} is over the cap of {proxy.max_nframes}",
                                 field="nframes")
        # A model trained or evaluated with at most N frames gets at most N (PRIMO-R1: 22).
        nframes = min(requested, cfg.frames.max_nframes or requested)
        if cfg.layout == "images" and nframes > cfg.frames.nframes:
            # One image part per frame: the server's --limit-mm-per-prompt image count is frames.nframes.
            raise InvalidRequest(f"backend uses the images layout, one image per frame; its servers take at most "
                                 f"frames.nframes={cfg.frames.nframes} images (--limit-mm-per-prompt)",
                                 field="nframes")
        max_pixels = request.max_pixels or cfg.frames.max_pixels
        if not MIN_MAX_PIXELS <= max_pixels <= proxy.max_pixels_limit:
            raise InvalidRequest(f"max_pixels must be within [{MIN_MAX_PIXELS}, "
                                 f"{proxy.max_pixels_limit}], got {max_pixels}", field="max_pixels")
        template_vars = template.variable_names
        overrides, variables, prompt_overrides, score_mode = {}, {}, {}, cfg.score_mode
        for key, value in request.backend_kwargs.items():
            if key in SAMPLING_FIELDS:
                overrides[key] = value
            elif key == "score_mode":
                if value not in SCORE_MODES:
                    raise InvalidRequest(f"score_mode must be one of {', '.join(SCORE_MODES)}",
                                         field="backend_kwargs.score_mode")
                score_mode = value
            elif key in SEED_PROMPT_KWARGS:
                if not isinstance(value, str) or len(value) > proxy.max_prompt_chars:
                    raise InvalidRequest(f"backend_kwargs.{key} must be a string of at most "
                                         f"{proxy.max_prompt_chars} characters (proxy.max_prompt_chars)",
                                         field=f"backend_kwargs.{key}")
                prompt_overrides[key] = value
            elif key in template_vars and key != "task_text":
                variables[key] = value
            else:
                raise InvalidRequest(
                    f"backend_kwargs.{key} is not a sampling field ({', '.join(sorted(SAMPLING_FIELDS))}), "
                    f"score_mode, one of the seed's {', '.join(SEED_PROMPT_KWARGS)}, or a variable of prompt "
                    f"{cfg.prompt!r} ({', '.join(sorted(template_vars - {'task_text'})) or 'none'})",
                    field=f"backend_kwargs.{key}")
        sampling = _override_sampling(cfg, overrides)
        frames = cfg.frames
        limits = FrameLimits(
            nframes=nframes, max_pixels=max_pixels, min_pixels=frames.min_pixels,
            video_max_pixels=frames.video_max_pixels, total_pixels=frames.total_pixels,
            image_min_pixels=frames.image_min_pixels, stills=layout_has_stills(cfg.layout),
            jpeg_quality=frames.jpeg_quality, default_source_fps=frames.default_source_fps,
            max_inline_frames=proxy.max_inline_frames, max_source_pixels=proxy.max_source_pixels)
        return _Resolved(sampling=sampling, score_mode=score_mode, variables=variables,
                         prompt_overrides=prompt_overrides, limits=limits, requested_nframes=requested)

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


def _presentation_fps(cfg: BackendConfig, request: ScoreRequest, frames: EncodedFrames) -> float:
    """The rate vLLM is told, by the backend's frames.presentation_fps (the same for every
    transport: a path, frames or frames_npy carrying one episode give one body)."""
    policy = cfg.frames.presentation_fps
    if policy == "seed":
        return request.video_fps or cfg.frames.default_video_fps
    if policy == "episode":
        return frames.sampled_fps
    return float(policy)


def _sampling_for_ask(cfg: BackendConfig, sampling: SamplingConfig, parse_round: int) -> dict[str, Any]:
    """The sampling fields of ask `parse_round` (0 = the first ask). A re-ask samples (so greedy
    decoding cannot repeat the unparseable reply) with the next seed."""
    fields = sampling.model_dump(exclude_none=True)
    if parse_round == 0:
        return fields
    reask = cfg.retry.reask
    fields["temperature"], fields["top_p"] = reask.temperature, reask.top_p
    if sampling.seed is not None:
        fields["seed"] = sampling.seed + parse_round
    return fields


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

