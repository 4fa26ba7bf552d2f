"""The /score pipeline: an episode's frames → prompt → chat body → vLLM under the retry policy →
a score with its provenance.

`score_frames` scores frames already loaded and applies no episode effects. `score_episode` owns
one episode (a /score request's, a batch item's, a dense curve's point's, a probe's) and runs it
inside one `Envelope` (proxy/pipelines/envelope.py). The envelope counts it, times it, shows it to
the live monitor and writes its audit line, a score's or a failure's, with what is needed to
reproduce it (prompt hash, frame hashes, sampling, attempts, the model's last reply), never media.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from proxy.answers.constraints import answer_regex
from proxy.answers.estimate import Estimated, estimate
from proxy.answers.per_frame import shuffle_for
from proxy.answers.probability import AnswerTokens
from proxy.answers.reply import ChatReply
from proxy.config import BackendConfig
from proxy.errors import ScoreParseError, UpstreamProtocolError, UpstreamTimeout
from proxy.media.variants import reversed_frames, shuffled_frames
from proxy.pipelines.batch import run_batch
from proxy.pipelines.envelope import BATCH_ITEM, PROBE, SCORE, Effects, Envelope
from proxy.pipelines.episode_frames import LoadedEpisode, describe_frames, load_episode
from proxy.pipelines.episode_trace import EpisodeTrace
from proxy.pipelines.services import Services
from proxy.prompting.layouts import (
    FIRST_FRAME_SLOT,
    FRAMES_SLOT,
    build_chat_body,
    check_token_budget,
    encode_body,
    layout_has_images,
)
from proxy.prompting.request import ResolvedRequest, resolve_request, sampling_for_ask
from proxy.prompting.templates import PromptTemplate, apply_seed_overrides
from proxy.protocol.common import FramesInfo, PromptInfo
from proxy.protocol.score import ParseInfo, ScoreRequest, ScoreResponse
from proxy.quality.probes import Probe, ProbedEpisode
from proxy.upstream.backends import Backend
from proxy.upstream.pool import Endpoint
from proxy.upstream.retry import Attempt

__all__ = ["SCORE", "FramesFor", "Prepared", "score_batch", "score_episode", "score_frames"]

# How an episode's frames are had once its request is checked: decoded (/score), made in a dense
# curve's one decode, or a scored episode's frames reordered (a probe).
FramesFor = Callable[["Prepared", BackendConfig], Awaitable[LoadedEpisode]]
SCORED_FIELDS = {"samples", "spread", "logprob", "probability", "per_frame", "shuffle"}


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


@dataclass(frozen=True)
class Prepared:
    """What a request asks of its backend, checked before any frame is decoded."""

    template: PromptTemplate
    resolved: ResolvedRequest
    prompt: PromptInfo


def prepare(services: Services, request: ScoreRequest, cfg: BackendConfig) -> Prepared:
    template = services.prompts.get(cfg.prompt)
    resolved = resolve_request(request, cfg, template, services.settings.proxy)
    prompt = PromptInfo(name=template.name, sha256=template.sha256, overrides={
        key: hashlib.sha256(text.encode()).hexdigest() for key, text in resolved.prompt_overrides.items()})
    return Prepared(template, resolved, prompt)


async def score_batch(services: Services, items: list[Any], *, budget_s: float | None) -> list[dict[str, Any]]:
    """Every item scored concurrently; each gets its own result or its own error, in order."""

    async def one(item: Any) -> ScoreResponse:
        request = ScoreRequest.model_validate(item)
        return await score_episode(services, request, BATCH_ITEM, budget_s=budget_s)

    return await run_batch(items, one, "batch item")


def _decoded(services: Services, request: ScoreRequest) -> FramesFor:
    async def frames_for(prepared: Prepared, cfg: BackendConfig) -> LoadedEpisode:
        return await load_episode(services, request, cfg, prepared.resolved.limits, prepared.resolved.requested_nframes)

    return frames_for


async def score_episode(services: Services, request: ScoreRequest, effects: Effects,
                        frames_for: FramesFor | None = None, *, budget_s: float | None,
                        described: dict[str, Any] | None = None) -> ScoreResponse:
    """Score one episode (or a part of one: a dense curve's point, a probe) inside its envelope,
    which applies the effects its route asks for (SCORE for /score). `frames_for`: how its frames
    are had (by default decoded from the request); `described`: fields its audit line adds."""
    started = time.perf_counter()
    frames_for = frames_for or _decoded(services, request)
    metadata = request.metadata.model_dump(exclude_none=True) if request.metadata else None
    trace = EpisodeTrace(backend=request.backend or "", task_text=request.task_text, metadata=metadata,
                         asked={"max_pixels": request.max_pixels, "backend_kwargs": request.backend_kwargs or None,
                                **({"prefix_end": request.prefix_end} if request.prefix_end is not None else {})},
                         kind=effects.kind or "score", dense=(described or {}).get("dense"))
    extra = {k: v for k, v in (described or {}).items() if k != "dense"}
    with Envelope(services, effects, request.backend, describe=lambda: {**trace.record(), **extra},
                  watch=(request.task_text, metadata)) as envelope:
        backend = envelope.backend
        trace.backend = backend.name
        prepared = prepare(services, request, backend.config)
        trace.prompt = prepared.prompt
        loaded = await frames_for(prepared, backend.config)
        trace.frames, trace.frame_store = loaded.info, loaded.stored
        response = await score_frames(services, backend, request, prepared, loaded, trace, budget_s=budget_s,
                                      started=started)
        timings = {"attempts": response.attempts, "timings_ms": response.timings_ms}
        if effects is PROBE:
            line = {**trace.record(), **extra, "probe_score": response.score,
                    "margin": extra["original_score"] - response.score, "raw_score": response.raw_score, **timings}
        else:
            line = {**trace.record(), "model": response.model, "score": response.score,
                    "raw_score": response.raw_score, "parse": response.parse.model_dump(),
                    **response.model_dump(include=SCORED_FIELDS, exclude_none=True), **timings}
        response.quality = envelope.done(line, score=response.score, seconds=response.timings_ms["total"] / 1e3)
    if effects.watched and services.probes is not None:
        services.probes.after(ProbedEpisode(
            backend=backend.name, task_text=request.task_text, metadata=metadata, score=response.score,
            has_room=backend.pool.has_room, rescore=lambda probe: _rescore(services, request, loaded, probe)))
    return response


async def _rescore(services: Services, request: ScoreRequest, loaded: LoadedEpisode, probe: Probe) -> float:
    """A probe's variant of a scored episode, scored with one attempt's time: a probe is not worth
    the retry policy's deadline. Its frames are the episode's, reordered (already in the frame store)."""
    frames, varied = loaded.frames, request
    if probe.kind == "reversed":
        frames = reversed_frames(frames)
    elif probe.kind == "shuffled":
        seed = f"{probe.seed}:{hashlib.sha256(b''.join(frames.jpegs)).hexdigest()[:16]}"
        frames, order = shuffled_frames(frames, seed)
        probe.described.update(seed=seed, order=order)
    else:
        varied = request.model_copy(update={"task_text": probe.task_text})

    async def frames_for(prepared: Prepared, cfg: BackendConfig) -> LoadedEpisode:
        return describe_frames(varied, cfg, frames, prepared.resolved.requested_nframes)

    backend = services.registry.resolve(request.backend)
    answer = await score_episode(services, varied, PROBE, frames_for, budget_s=backend.config.retry.timeout_s,
                                 described=probe.described)
    return answer.score


async def score_frames(services: Services, backend: Backend, request: ScoreRequest, prepared: Prepared,
                       loaded: LoadedEpisode, trace: EpisodeTrace, *, budget_s: float | None,
                       started: float) -> ScoreResponse:
    """Score frames already loaded: prompt, body, the backend's replicas under the retry policy, the
    reply read by the template's declared answer. No episode effects: `trace` keeps what it went through
    for the caller's audit line. Counted here: each reply (finish reason, tokens) and parse failure."""
    cfg, resolved, frames = backend.config, prepared.resolved, loaded.frames
    per_frame = resolved.answer.per_frame
    slots = {"first_frame": FIRST_FRAME_SLOT, "frames": FRAMES_SLOT} if per_frame else {}
    system, user_text = prepared.template.render({"task_text": request.task_text, **resolved.variables}, slots)
    system, user_text = apply_seed_overrides(system, user_text, request.task_text, resolved.prompt_overrides)
    second = (f" and a second video of {len(frames.extra.jpegs)} at {frames.extra.width}x{frames.extra.height}"
              if frames.extra is not None else "")
    check_token_budget(cfg, resolved.sampling.max_tokens, loaded.info.vision_tokens,
                       len(user_text) + len(system or ""),
                       f"{len(frames.jpegs)} frames at {frames.width}x{frames.height}{second}")

    shuffle = shuffle_for(frames, resolved.shuffle_seed) if per_frame else None
    fields = resolved.upstream_fields
    if per_frame and resolved.estimate.constrain:  # one line per frame SHOWN (a short episode shows fewer)
        fields = {**fields, "structured_outputs": {"regex": answer_regex(resolved.answer, len(shuffle.order))}}
    body = build_chat_body(cfg, resolved.sampling, system, user_text, frames, loaded.fps, fields,
                           shown=(shuffle, per_frame) if shuffle and per_frame else None)
    words = resolved.answer.probability
    first_ask = encode_body(body) if not words else b""
    answer_tokens: dict[str, AnswerTokens] = {}  # a probability answer's ids, by the endpoint that replied
    upstream_started = time.perf_counter()

    async def body_for(endpoint: Endpoint, attempt: Attempt) -> bytes:
        sampling = sampling_for_ask(cfg, resolved.sampling, attempt.parse_round)
        trace.sampling, trace.asks = sampling, attempt.parse_round + 1
        if not words:
            return first_ask if attempt.parse_round == 0 else encode_body(body, sampling)
        # The endpoint's own ids of the two words go into the body; the lookups and the chat share
        # one call's time.
        ends = time.monotonic() + attempt.timeout_s
        tokens = answer_tokens[endpoint.base_url] = await services.answer_tokens.resolve(
            endpoint, cfg.model, words, timeout_s=attempt.timeout_s, lookup_timeout_s=cfg.retry.timeout_s,
            api_key=cfg.api_key())
        left = ends - time.monotonic()
        if left <= 0:
            raise UpstreamTimeout(f"{endpoint.base_url} used the call's {attempt.timeout_s:.1f}s on /tokenize",
                                  endpoint=endpoint.base_url)
        attempt.timeout_s = left
        return encode_body(body, {**sampling, "logprob_token_ids": tokens.ids})

    def seen(reply: ChatReply) -> None:
        trace.saw(reply)
        count_reply(services, backend.name, reply)

    def parse(reply: ChatReply) -> Estimated:
        try:
            return estimate(reply, resolved.answer, resolved.score_mode, resolved.estimate,
                            answer_tokens.get(reply.endpoint), shuffle)
        except ScoreParseError:
            services.metrics.parse_failures.labels(backend.name).inc()
            raise
        except UpstreamProtocolError:
            if words:  # its ids may be stale: that endpoint is asked for them again next time
                services.answer_tokens.forget(reply.endpoint)
            raise

    reply, estimated, calls = await backend.ask(services.metrics, services.upstream.chat, body_for, parse,
                                                budget_s=budget_s, on_reply=seen,
                                                group=routing_group(request, cfg.layout, loaded.info))
    parsed = estimated.parsed
    finished = time.perf_counter()
    services.metrics.stage.labels(stage="upstream").observe(finished - upstream_started)
    return ScoreResponse(
        score=parsed.score, raw_score=parsed.raw_score, backend=backend.name,
        model=reply.model or cfg.model, output_text=reply.text,
        parse=ParseInfo(mode=parsed.mode, scale=parsed.scale, source=parsed.source,
                        finish_reason=reply.finish_reason),
        attempts=calls, asks=trace.asks, prompt=prepared.prompt, frames=loaded.info,
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


def count_reply(services: Services, backend: str, reply: ChatReply) -> None:
    """Every reply that came back, parsed or not: by finish_reason, and its tokens."""
    services.metrics.replies.labels(backend, reply.finish_reason or "unknown").inc()
    for kind in ("prompt_tokens", "completion_tokens"):
        if isinstance((reply.usage or {}).get(kind), int):
            services.metrics.tokens.labels(backend, kind).inc(reply.usage[kind])
