"""The /score pipeline's episodes: each owned once, inside its envelope.

`score_episode` owns one episode (a /score request's, a batch item's, a dense curve's point's, a
probe's): it opens an `Envelope` (proxy/pipelines/envelope.py) with its route's effects, has its
frames (decoded, or given by its owner), scores them (`frames_scoring.score_frames`) and records the
outcome once: counters, the live monitor, and the audit line with what is needed to reproduce it
(prompt hash, frame hashes, sampling, attempts, the model's last reply), never media. An episode
that names a cascade goes through its stages instead (proxy/pipelines/cascade.py).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from proxy.config import BackendConfig
from proxy.media.variants import reversed_frames, shuffled_frames
from proxy.pipelines.batch import run_batch
from proxy.pipelines.cascade import score_cascade
from proxy.pipelines.cascade_state import BatchEscalation
from proxy.pipelines.envelope import BATCH_ITEM, PROBE, SCORE, Effects, Envelope
from proxy.pipelines.episode_frames import LoadedEpisode, describe_frames, load_episode
from proxy.pipelines.episode_trace import EpisodeTrace
from proxy.pipelines.frames_scoring import Prepared, prepare, score_frames
from proxy.pipelines.services import Services
from proxy.protocol.score import ScoreRequest, ScoreResponse
from proxy.quality.probes import Probe, ProbedEpisode

__all__ = ["SCORE", "FramesFor", "score_batch", "score_episode"]

# How an episode's frames are had once its request is checked: decoded (/score), made in a dense
# curve's one decode, or a scored episode's frames reordered (a probe).
FramesFor = Callable[["Prepared", BackendConfig], Awaitable[LoadedEpisode]]
SCORED_FIELDS = {"samples", "spread", "logprob", "probability", "per_frame", "shuffle"}


async def score_batch(services: Services, items: list[Any], *, budget_s: float | None) -> list[dict[str, Any]]:
    """Every item scored concurrently; each gets its own result or its own error, in order. The items
    of one cascade share its decisions: at most its share of them go on past each stage."""
    named = [item.get("backend") if isinstance(item, dict) else None for item in items]
    cascades = {name: services.cascades[name] for label in named if (name := services.registry.cascade(label))}
    decisions = {name: [BatchEscalation(sum(services.registry.cascade(label) == name for label in named),
                                        state.config.max_escalated_fraction) for _ in state.config.stages[:-1]]
                 for name, state in cascades.items()}

    async def one(index: int, item: Any) -> ScoreResponse:
        cascade = services.registry.cascade(named[index])
        try:
            request = ScoreRequest.model_validate(item)
        except ValidationError:  # never reaches its cascade's decisions: the others must not wait for it
            for decision in decisions.get(cascade, ()):
                decision.leave(index)
            raise
        if cascade is not None:
            return await score_cascade(services, request, services.cascades[cascade], BATCH_ITEM, budget_s=budget_s,
                                       batch=decisions[cascade], item=index)
        return await score_episode(services, request, BATCH_ITEM, budget_s=budget_s)

    return await run_batch(list(enumerate(items)), lambda pair: one(*pair), "batch item")


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
    cascade = services.registry.cascade(request.backend)
    if cascade is not None:  # a cascade's stages are asked in turn
        return await score_cascade(services, request, services.cascades[cascade], effects, budget_s=budget_s)
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


