"""Scoring of frames already loaded: the template rendered, the chat body built, the backend asked
under the retry policy, the reply read by the template's declared answer.

Nothing here applies an episode's effects (counters, the monitor, the audit line): whoever owns
the episode does, once, through its envelope. What is counted here belongs to the calls: each
reply by finish reason and tokens, each parse failure. A /score episode, a dense curve's point, a
probe and each stage of a cascade all score their frames here.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass

from proxy.answers.constraints import answer_regex
from proxy.answers.estimate import Estimated, estimate
from proxy.answers.per_frame import shuffle_for
from proxy.answers.probability import AnswerTokens
from proxy.answers.reply import ChatReply
from proxy.config import BackendConfig
from proxy.errors import ScoreParseError, UpstreamProtocolError, UpstreamTimeout
from proxy.pipelines.episode_frames import LoadedEpisode
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
from proxy.upstream.backends import Backend
from proxy.upstream.pool import Endpoint
from proxy.upstream.retry import Attempt

__all__ = ["Prepared", "count_reply", "prepare", "routing_group", "score_frames"]


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
