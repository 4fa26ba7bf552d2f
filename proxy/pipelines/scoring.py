"""The /score pipeline: media → prompt → layout → upstream (under the retry policy) → parse.

No FastAPI here: the routes are thin wrappers around `Scorer.score`. Every episode, scored or
failed, leaves one audit line with what is needed to reproduce it (prompt hash, frame hashes,
sampling, attempts, the model's last reply) — never media.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import TYPE_CHECKING, Any

from proxy.answers.constraints import answer_regex
from proxy.answers.estimate import Estimated, estimate
from proxy.answers.per_frame import shuffle_for
from proxy.answers.probability import AnswerTokens
from proxy.answers.reply import ChatReply
from proxy.audit import AuditLog
from proxy.config import BackendConfig, SamplingConfig, Settings
from proxy.errors import (
    InvalidRequest,
    ProxyError,
    ScoreParseError,
    TokenBudgetExceeded,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from proxy.media.budget import DecodeBudget, MediaExecutor
from proxy.media.decode import FrameLimits
from proxy.media.encode import EncodedFrames, prepare_frames
from proxy.media.frame_store import FrameStore
from proxy.media.views import check_views, extra_view_info, prepare_views
from proxy.metrics import Metrics
from proxy.pipelines.batch import run_batch
from proxy.pipelines.episode_trace import EpisodeTrace
from proxy.prompting.layouts import (
    FIRST_FRAME_SLOT,
    FRAMES_SLOT,
    build_chat_body,
    encode_body,
    layout_has_images,
    prompt_token_bound,
    vision_token_count,
)
from proxy.prompting.request import presentation_fps, resolve_request, sampling_for_ask
from proxy.prompting.templates import PromptStore, apply_seed_overrides
from proxy.protocol.common import FramesInfo, PromptInfo
from proxy.protocol.score import ParseInfo, QualityStatus, ScoreRequest, ScoreResponse, ViewSource
from proxy.quality.monitor import QualityMonitor
from proxy.upstream.answer_tokens import AnswerTokenIds
from proxy.upstream.backends import Backend, BackendRegistry
from proxy.upstream.client import UpstreamClient
from proxy.upstream.pool import Endpoint
from proxy.upstream.retry import Attempt, call_with_retries

if TYPE_CHECKING:
    from proxy.pipelines.probes import InvarianceProbes

log = logging.getLogger(__name__)


def routing_group(request: ScoreRequest, layout: str, frames: FramesInfo) -> str | None:
    """What this episode's prompt shares with others (routing.policy affinity): the caller's
    group_id, else the first frame where the prompt opens with it (vLLM hashes an image by its
    bytes, and the same pixels make the same JPEG here), else nothing worth a replica."""
    if request.metadata is not None and request.metadata.group_id is not None:
        return f"group:{request.metadata.group_id}"
    if layout == "primo_interleave" and frames.still_sha256:
        return f"frame:{frames.still_sha256[0]}"
    if layout_has_images(layout):
        return f"frame:{frames.sha256[0]}"
    return None


class Scorer:
    def __init__(self, settings: Settings, registry: BackendRegistry, prompts: PromptStore,
                 upstream: UpstreamClient, metrics: Metrics, audit: AuditLog,
                 frame_store: FrameStore | None = None, *, media: MediaExecutor,
                 quality: QualityMonitor | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.prompts = prompts
        self.upstream = upstream
        self.metrics = metrics
        self.audit = audit
        self.frame_store = frame_store
        self.media = media  # the app's bounded media threads: every decode and encode runs there
        self.quality = quality  # live agreement with env_success per (run, backend, task), the alarm
        self.probes: InvarianceProbes | None = None  # set by the app when quality.probes.fraction > 0
        self.answer_tokens = AnswerTokenIds(upstream)  # a probability answer's word ids, per endpoint

    async def score(self, request: ScoreRequest, *, admit: bool = True, budget_s: float | None = None,
                    encoded: EncodedFrames | None = None, dense: dict[str, Any] | None = None,
                    probe: dict[str, Any] | None = None) -> ScoreResponse:
        """Score one episode. `admit=False` skips the queue-full check (batch items were
        admitted as a whole); they still wait for endpoint slots like everyone else.
        `budget_s`: how long the caller will wait (its deadline caps the retry policy's).
        `encoded`, `dense`: a prefix of a dense curve, its frames made in the one decode of the curve.
        `probe`: an invariance probe (proxy/pipelines/probes.py, `encoded` its frames): not an episode —
        no episode counters, no quality window, an audit line of kind `probe` described by it."""
        started = time.perf_counter()
        try:
            backend = self.registry.resolve(request.backend)
        except ProxyError as err:
            self.metrics.episodes.labels("none", err.code).inc()
            raise
        trace = EpisodeTrace(backend=backend.name, task_text=request.task_text,
                       metadata=request.metadata.model_dump(exclude_none=True) if request.metadata else None,
                       asked={"max_pixels": request.max_pixels, "backend_kwargs": request.backend_kwargs or None,
                              **({"prefix_end": request.prefix_end} if request.prefix_end is not None else {})},
                       kind="probe" if probe else "dense_point" if dense else "score", dense=dense)
        episode = dense is None and probe is None
        self.metrics.in_flight.labels(backend.name).inc()
        try:
            if admit:
                backend.pool.check_admission()
            response = await self._score(request, backend, started, budget_s, trace, encoded)
        except ProxyError as err:
            err.backend = backend.name  # the true label for the HTTP request counter
            if episode:  # a curve's prefixes and probes are not episodes (the route counts the curve)
                self.metrics.episodes.labels(backend.name, err.code).inc()
                if isinstance(err, ScoreParseError) and self.quality is not None:  # a reply, but no score
                    self._watch("window", lambda: self.quality.observe(backend.name, request.task_text,
                                                                       trace.metadata, None))
            self.audit.write({**trace.record(), **(probe or {}), "error": {"code": err.code, "message": err.message},
                              "attempts": err.attempts})
            raise
        finally:
            self.metrics.in_flight.labels(backend.name).dec()
        if probe is not None:
            self.audit.write({**trace.record(), **probe, "probe_score": response.score,
                              "margin": probe["original_score"] - response.score, "raw_score": response.raw_score,
                              "attempts": response.attempts, "timings_ms": response.timings_ms})
            return response
        if episode:
            response.quality = self.watch_episode(backend.name, request.task_text, trace.metadata, response.score)
            self.metrics.episodes.labels(backend.name, "ok").inc()
            self.metrics.scores.labels(backend.name).observe(response.score)
            self.metrics.latency.labels(backend.name).observe(response.timings_ms["total"] / 1e3)
        self.audit.write({**trace.record(), "model": response.model, "score": response.score,
                          "raw_score": response.raw_score, "parse": response.parse.model_dump(),
                          **response.model_dump(include={"samples", "spread", "logprob", "probability", "per_frame",
                                                   "shuffle"}, exclude_none=True),
                          "attempts": response.attempts, "timings_ms": response.timings_ms})
        if episode and self.probes is not None and trace.encoded is not None:
            encoded = trace.encoded
            self._watch("probes", lambda: self.probes.after(request, backend, trace.metadata, response.score, encoded))
        return response

    def watch_episode(self, backend: str, task_text: str, metadata: dict[str, Any] | None,
                      score: float) -> QualityStatus | None:
        """The live monitor's view of one scored episode (also a dense curve's whole episode)."""
        if self.quality is None:
            return None
        said = self._watch("window", lambda: self.quality.observe(backend, task_text, metadata, score))
        return QualityStatus.model_validate(said) if said is not None else None

    @staticmethod
    def _watch(what: str, call: Any) -> Any:
        """The monitor never fails an episode that was scored: its own error is logged, never the answer's."""
        try:
            return call()
        except Exception:  # noqa: BLE001 (any bug here must not turn a score into a 500)
            log.exception("reward-quality %s failed; the episode's answer is unaffected", what)
            return None

    async def _score(self, request: ScoreRequest, backend: Backend, started: float,
                     budget_s: float | None, trace: EpisodeTrace, encoded: EncodedFrames | None) -> ScoreResponse:
        cfg = backend.config
        template = self.prompts.get(cfg.prompt)
        resolved = resolve_request(request, cfg, template, self.settings.proxy)
        trace.prompt = PromptInfo(name=template.name, sha256=template.sha256, overrides={
            key: hashlib.sha256(text.encode()).hexdigest() for key, text in resolved.prompt_overrides.items()})
        per_frame = resolved.answer.per_frame
        slots = {"first_frame": FIRST_FRAME_SLOT, "frames": FRAMES_SLOT} if per_frame else {}
        system, user_text = template.render({"task_text": request.task_text, **resolved.variables}, slots)
        system, user_text = apply_seed_overrides(system, user_text, request.task_text, resolved.prompt_overrides)

        frames, fps, trace.frames, trace.frame_store = await self.load_episode(
            request, cfg, resolved.limits, resolved.requested_nframes, encoded, store=trace.kind != "probe")
        trace.encoded = frames
        self._check_token_budget(cfg, resolved.sampling, frames, len(user_text) + len(system or ""))

        shuffle = shuffle_for(frames, resolved.shuffle_seed) if per_frame else None
        fields = resolved.upstream_fields
        if per_frame and resolved.estimate.constrain:  # one line per frame SHOWN (a short episode shows fewer)
            fields = {**fields, "structured_outputs": {"regex": answer_regex(resolved.answer, len(shuffle.order))}}
        body = build_chat_body(cfg, resolved.sampling, system, user_text, frames, fps, fields,
                               shown=(shuffle, per_frame) if shuffle and per_frame else None)
        group = routing_group(request, cfg.layout, trace.frames)
        words = resolved.answer.probability
        first_ask = encode_body(body) if not words else b""
        answer_tokens: dict[str, AnswerTokens] = {}  # a probability answer's ids, by the endpoint that replied
        upstream_started = time.perf_counter()

        async def send(attempt: Attempt) -> ChatReply:
            sampling = sampling_for_ask(cfg, resolved.sampling, attempt.parse_round)
            trace.sampling, trace.asks = sampling, attempt.parse_round + 1

            async def ask(endpoint: Endpoint) -> ChatReply:
                payload = first_ask if attempt.parse_round == 0 else encode_body(body, sampling)
                timeout_s = attempt.timeout_s
                if words:  # the endpoint's own ids of the two words go into the body
                    ends = time.monotonic() + timeout_s  # the lookups and the chat: one call's time
                    tokens = answer_tokens[endpoint.base_url] = await self.answer_tokens.resolve(
                        endpoint, cfg.model, words, timeout_s=timeout_s, lookup_timeout_s=cfg.retry.timeout_s,
                        api_key=cfg.api_key())
                    payload = encode_body(body, {**sampling, "logprob_token_ids": tokens.ids})
                    timeout_s = ends - time.monotonic()
                    if timeout_s <= 0:
                        raise UpstreamTimeout(f"{endpoint.base_url} used the call's {attempt.timeout_s:.1f}s on "
                                              "/tokenize", endpoint=endpoint.base_url)
                return await self.upstream.chat(endpoint, payload, timeout_s=timeout_s, api_key=cfg.api_key())

            return await backend.call(attempt, self.metrics, ask, group)

        def seen(reply: ChatReply) -> None:
            trace.saw(reply)
            self.count_reply(backend.name, reply)

        def parse(reply: ChatReply) -> Estimated:
            try:
                return estimate(reply, resolved.answer, resolved.score_mode, resolved.estimate,
                                answer_tokens.get(reply.endpoint), shuffle)
            except ScoreParseError:
                self.metrics.parse_failures.labels(backend.name).inc()
                raise
            except UpstreamProtocolError:
                if words:  # its ids may be stale: that endpoint is asked for them again next time
                    self.answer_tokens.forget(reply.endpoint)
                raise

        reply, estimated, calls = await call_with_retries(cfg.retry, send, parse, budget_s=budget_s,
                                                          on_reply=seen)
        parsed = estimated.parsed
        finished = time.perf_counter()
        self.metrics.stage.labels(stage="upstream").observe(finished - upstream_started)
        return ScoreResponse(
            score=parsed.score, raw_score=parsed.raw_score, backend=backend.name,
            model=reply.model or cfg.model, output_text=reply.text,
            parse=ParseInfo(mode=parsed.mode, scale=parsed.scale, source=parsed.source,
                            finish_reason=reply.finish_reason),
            attempts=calls, asks=trace.asks, prompt=trace.prompt, frames=trace.frames,
            sampling=trace.sampling or {}, usage=reply.usage, endpoint=reply.endpoint,
            samples=estimated.samples, spread=estimated.spread, logprob=estimated.logprob,
            probability=estimated.probability,
            per_frame=[{"frame_index": index, "score": value.score, "raw_score": value.raw_score,
                        "shown_as": shuffle.order.index(n) + 1}
                       for n, (index, value) in enumerate(zip(frames.indices[1:], estimated.per_frame, strict=True))]
            if estimated.per_frame and shuffle else None,
            shuffle={"seed": shuffle.seed, "order": list(shuffle.order)} if shuffle else None,
            constrained=resolved.estimate.constrain,
            timings_ms={"load": round(frames.load_ms, 3), "encode": round(frames.encode_ms, 3),
                        "upstream": round((finished - upstream_started) * 1e3, 3),
                        "total": round((finished - started) * 1e3, 3)},
        )

    async def score_batch(self, items: list[Any], *, budget_s: float | None = None) -> list[dict[str, Any]]:
        """Every item scored concurrently; each gets its own result or its own error, in order."""
        return await run_batch(items, lambda item: self.score(ScoreRequest.model_validate(item), admit=False,
                                                              budget_s=budget_s), "batch item")

    async def load_episode(self, request: ScoreRequest, cfg: BackendConfig, limits: FrameLimits, requested: int,
                           encoded: EncodedFrames | None = None, *, store: bool = True
                           ) -> tuple[EncodedFrames, float, FramesInfo, dict[str, Any] | None]:
        """One episode's frames as sent, the presentation rate, their provenance and what the frame
        store did with them (shared with /compare and /progress). `requested`: nframes asked for."""
        placement = check_views(cfg.frames.extra_view, given=request.extra_view is not None,
                                frame_rules=request.frame_rules is not None)
        if encoded is not None:  # a prefix of a dense curve: made in the curve's one decode
            frames = encoded
        elif placement is not None:  # two cameras, decoded at the same indices within one budget
            frames = await self.media.run(lambda budget: prepare_views(
                limits, budget, placement, prefix_end=request.prefix_end, main=self.source_of(request),
                extra={**self.source_of(request.extra_view), "fps": request.fps}))
        else:
            frames = await self.media.run(lambda budget: self._load_frames(request, limits, budget))
        made = len(frames.jpegs) + len(frames.stills)  # the main view's (a second camera's go raw)
        if encoded is None and request.frame_rules is not None and frames.forwarded != made:
            # The caller said it encoded for these rules: a frame the proxy had to redo is its bug, never
            # a silent second resize of already-resized pixels.
            raise InvalidRequest(f"frames sent with frame_rules must be RGB JPEGs at the rules' sizes (forwarded "
                                 f"as they are); {made - frames.forwarded} were not: send raw frames instead",
                                 field="frames")
        fps = presentation_fps(cfg, request, frames)
        info = FramesInfo(
            count=len(frames.jpegs), requested=requested, indices=frames.indices,
            source_count=frames.source_count, size=(frames.width, frames.height), still_size=frames.still_size,
            fps=round(fps, 6), sampled_fps=round(frames.sampled_fps, 6),
            vision_tokens=vision_token_count(cfg.layout, frames), sha256=frames.sha256,
            still_sha256=frames.still_sha256, forwarded=frames.forwarded,
            extra_view=extra_view_info(placement, frames) if placement else None)
        stored = None
        if self.frame_store is not None and store:  # a probe's frames are its episode's, kept already
            extra = frames.extra.jpegs if frames.extra is not None else []
            stored = (await self.frame_store.put([*frames.jpegs, *frames.stills, *extra],
                                                 [*info.sha256, *info.still_sha256,
                                                  *(info.extra_view.sha256 if info.extra_view else [])])).record()
        self.metrics.stage.labels(stage="load").observe(frames.load_ms / 1e3)
        self.metrics.stage.labels(stage="encode").observe(frames.encode_ms / 1e3)
        return frames, fps, info, stored

    def count_reply(self, backend: str, reply: ChatReply) -> None:
        """Every reply that came back, parsed or not: by finish_reason, and its tokens."""
        self.metrics.replies.labels(backend, reply.finish_reason or "unknown").inc()
        for kind in ("prompt_tokens", "completion_tokens"):
            if isinstance((reply.usage or {}).get(kind), int):
                self.metrics.tokens.labels(backend, kind).inc(reply.usage[kind])

    def _load_frames(self, request: ScoreRequest, limits: FrameLimits, budget: DecodeBudget) -> EncodedFrames:
        return prepare_frames(limits, budget, prefix_end=request.prefix_end, **self.source_of(request))

    def source_of(self, request: ScoreRequest | ViewSource) -> dict[str, Any]:
        """The request's (or its second camera's) frame source as `decode_source` takes it (a video_path
        is checked against the roots, opened and sniffed there, on the media thread: proxy/media/file.py)."""
        return {"video_path": request.video_path, "media_roots": self.settings.proxy.allowed_media_roots,
                "frames": request.frames, "frames_npy": request.frames_npy, "fps": getattr(request, "fps", None),
                "stills": getattr(request, "stills", None)}

    @staticmethod
    def _check_token_budget(cfg: BackendConfig, sampling: SamplingConfig, frames: EncodedFrames,
                            text_chars: int) -> None:
        if cfg.max_model_len is None:
            return
        needed = prompt_token_bound(cfg.layout, frames, text_chars) + sampling.max_tokens
        if needed > cfg.max_model_len:
            second = (f" and a second video of {len(frames.extra.jpegs)} at {frames.extra.width}x{frames.extra.height}"
                      if frames.extra is not None else "")
            raise TokenBudgetExceeded(
                f"{len(frames.jpegs)} frames at {frames.width}x{frames.height}{second} need about {needed} "
                f"tokens with max_tokens {sampling.max_tokens}, over max_model_len "
                f"{cfg.max_model_len}; lower nframes or max_pixels", field="nframes")


