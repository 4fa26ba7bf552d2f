"""A cascade's episode: its stages asked in turn on one decode of the episode, each later stage only
where the one before it was in doubt (its band), disagreed with the stage before it, or was drawn for
the random audit; within the budget (a batch's share, or a window's for single calls) and the
caller's deadline.

The answer is the last stage that ran, with every stage that ran in `cascade.stages` (backend,
score, tokens, seconds, why it went on or why it stopped) and `usage` summed over them. One
envelope holds the episode, named by the cascade: its counters, its audit line and the monitor's
window for the final score. Each stage's own score also goes to the monitor under a key of its own,
`<cascade>/<backend>`, so a cheap stage that drifts raises the same alarm as a backend would, named,
and never mixes with that backend used directly.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from proxy.config import BackendConfig
from proxy.errors import UpstreamTimeout
from proxy.media.encode import EncodedFrames
from proxy.pipelines.cascade_state import BatchEscalation, CascadeState, audit_draw
from proxy.pipelines.envelope import Effects, Envelope
from proxy.pipelines.episode_frames import decode_episode, describe_frames, store_frames
from proxy.pipelines.episode_trace import EpisodeTrace
from proxy.pipelines.frames_scoring import prepare, score_frames
from proxy.pipelines.services import Services
from proxy.prompting.layouts import layout_has_stills
from proxy.prompting.request import frame_limits
from proxy.protocol.score import CascadeInfo, CascadeStageInfo, ScoreRequest, ScoreResponse
from proxy.quality.monitor import stage_label
from proxy.upstream.backends import Backend

__all__ = ["decode_stage", "score_cascade"]


def decode_stage(backends: list[Backend]) -> Backend:
    """The stage whose frame rules the cascade publishes and decodes by: one that shows the first and
    last frame as stills when any does (the others ignore them), else the first."""
    return next((b for b in backends if layout_has_stills(b.config.layout or "")), backends[0])


def _episode_identity(request: ScoreRequest, frames: EncodedFrames) -> str:
    episode_id = request.metadata.episode_id if request.metadata is not None else None
    if episode_id is not None:
        return f"episode:{episode_id}"
    return "frames:" + ",".join(frames.sha256) + "|" + request.task_text


async def score_cascade(services: Services, request: ScoreRequest, state: CascadeState, effects: Effects, *,
                        budget_s: float | None, batch: list[BatchEscalation] | None = None,
                        item: int = 0) -> ScoreResponse:
    """One episode through the cascade `state` names. `batch`: the batch's decision per stage (none
    for a single call, whose budget is the cascade's window)."""
    try:
        return await _through_stages(services, request, state, effects, budget_s, batch, item)
    finally:
        for decision in batch or ():
            decision.leave(item)


async def _through_stages(services: Services, request: ScoreRequest, state: CascadeState, effects: Effects,
                          budget_s: float | None, batch: list[BatchEscalation] | None, item: int) -> ScoreResponse:
    started = time.perf_counter()
    ends = time.monotonic() + budget_s if budget_s is not None else None
    cfg = state.config
    stages = [services.registry.resolve(stage.backend) for stage in cfg.stages]
    metadata = request.metadata.model_dump(exclude_none=True) if request.metadata else None
    ran: list[CascadeStageInfo] = []
    record: dict[str, Any] = {"backend": state.name, "task_text": request.task_text, "metadata": metadata,
                              "asked": {"max_pixels": request.max_pixels,
                                        "backend_kwargs": request.backend_kwargs or None}}
    envelope = Envelope(services, effects, None, resolved=dataclasses.replace(stages[0], name=state.name),
                        describe=lambda: {**record, "cascade": {"stages": [s.model_dump() for s in ran],
                                                                "threshold": cfg.threshold}},
                        watch=(request.task_text, metadata))
    with envelope:
        decoder = decode_stage(stages)
        limits, requested = frame_limits(request, decoder.config, services.settings.proxy)
        frames = await decode_episode(services, request, decoder.config, limits)
        stored = (await store_frames(services, describe_frames(request, decoder.config, frames, requested))).stored
        identity = _episode_identity(request, frames)
        answers: list[ScoreResponse] = []
        stopped: str | None = None
        for index, backend in enumerate(stages):
            left = ends - time.monotonic() if ends is not None else None
            if index > 0:
                expected = state.expected_seconds(backend.name)
                if left is not None and (left <= 0 or (expected is not None and expected > left)):
                    stopped = _out_of_time(cfg.on_deadline, backend.name, left, expected)
                    break
            try:
                answer = await _stage(services, request, backend, frames, requested, left)
            except UpstreamTimeout:
                # The rule is for the caller's budget: a replica's own timeout without one is an error.
                if index == 0 or cfg.on_deadline == "error" or ends is None:
                    raise
                stopped = "deadline"
                break
            state.took(backend.name, answer.timings_ms["total"] / 1e3)
            answers.append(answer)
            ran.append(CascadeStageInfo(backend=backend.name, score=answer.score, raw_score=answer.raw_score,
                                        usage=answer.usage, attempts=answer.attempts,
                                        seconds=round(answer.timings_ms["total"] / 1e3, 6)))
            if index == len(stages) - 1:
                break
            why, stopped = await _go_on(cfg, state, index, answers, identity, batch, item)
            ran[-1].went_on = why
            if why is None:
                break
        final = answers[-1]
        usage: dict[str, int] = {}
        for answer in answers:
            for key, value in (answer.usage or {}).items():
                if isinstance(value, int):
                    usage[key] = usage.get(key, 0) + value
        info = CascadeInfo(name=state.name, stages=ran, final_stage=final.backend, stopped=stopped,
                           threshold=cfg.threshold)
        total_s = time.perf_counter() - started
        response = final.model_copy(update={
            "backend": state.name, "usage": usage, "attempts": sum(a.attempts for a in answers),
            "cascade": info, "timings_ms": {**final.timings_ms, "total": round(total_s * 1e3, 3)}})
        envelope.observe_cascade(ran, cfg.threshold, stopped)
        _count_audit(services, state, ran)
        line = {**envelope.describe(), "model": response.model, "score": response.score,
                "raw_score": response.raw_score, "parse": response.parse.model_dump(),
                "frames": response.frames.model_dump(include={"count", "requested", "indices", "size",
                                                               "still_size", "fps", "sampled_fps", "sha256"}),
                "frame_store": stored, "usage": usage, "final_stage": final.backend, "stopped": stopped,
                "attempts": response.attempts, "timings_ms": response.timings_ms}
        response.quality = envelope.done(line, score=response.score, seconds=total_s)
        # Each stage's own key, after the episode's line: an alarm a stage raises follows the line
        # that carries its score, as a restart reads them back.
        for stage in ran:
            envelope.observe_as(stage_label(state.name, stage.backend), stage.score)
        if batch is None and not any(stage.went_on in ("band", "disagree") for stage in ran):
            state.note_single()
        return response


async def _stage(services: Services, request: ScoreRequest, backend: Backend, frames: EncodedFrames,
                 requested: int, budget_s: float | None) -> ScoreResponse:
    """One stage scores the cascade's frames (its stills only when its layout shows them)."""
    cfg: BackendConfig = backend.config
    asked = request.model_copy(update={"backend": backend.name, "frame_rules": None, "stills": None})
    prepared = prepare(services, asked, cfg)
    shown = frames if layout_has_stills(cfg.layout or "") else _without_stills(frames)
    loaded = describe_frames(asked, cfg, shown, requested)
    trace = EpisodeTrace(backend=backend.name, task_text=request.task_text, prompt=prepared.prompt,
                         frames=loaded.info)
    return await score_frames(services, backend, asked, prepared, loaded, trace, budget_s=budget_s,
                              started=time.perf_counter())


def _without_stills(frames: EncodedFrames) -> EncodedFrames:
    """The frames without their stills, for a stage whose layout shows none. The JPEGs are the same
    objects, so their hashes carry over: every stage's provenance reuses one hashing of the episode."""
    if not frames.stills:
        return frames
    shown = dataclasses.replace(frames, stills=[], still_size=None)
    shown.__dict__["sha256"] = frames.sha256  # functools.cached_property's own slot
    return shown


async def _go_on(cfg: Any, state: CascadeState, index: int, answers: list[ScoreResponse], identity: str,
                 batch: list[BatchEscalation] | None, item: int) -> tuple[str | None, str | None]:
    """(why the episode goes on past stage `index`, or None; why it stopped, or None)."""
    stage, score = cfg.stages[index], answers[-1].score
    in_band = stage.band is not None and stage.band[0] <= score <= stage.band[1]
    disagrees = stage.disagree and (answers[-2].score >= cfg.threshold) != (score >= cfg.threshold)
    doubt = "band" if in_band else "disagree" if disagrees else None
    audited = doubt is None and audit_draw(f"{state.name}|{index}|{identity}") < stage.audit_fraction
    if batch is not None:
        decision = batch[index]
        if doubt is None:
            decision.leave(item)
        elif not await decision.ask(item, abs(score - cfg.threshold)):
            return None, "budget"
    elif doubt is not None and not state.allow_single():
        return None, "budget"
    if doubt is not None:
        return doubt, None
    return ("audit", None) if audited else (None, "sure")


def _out_of_time(rule: str, backend: str, left: float, expected: float | None) -> str:
    if rule == "error":
        said = f"{expected:.1f}s, its recent median" if expected is not None else "any time"
        raise UpstreamTimeout(f"the caller's budget has {max(left, 0):.1f}s left, and stage {backend!r} takes {said}: "
                              "the cascade stops here (cascades.on_deadline: error)", retryable=True)
    return "deadline"


def _count_audit(services: Services, state: CascadeState, ran: list[CascadeStageInfo]) -> None:
    """Each stage that went on counts by why; an audited stage that lands across the threshold from
    the final stage counts as the audit's disagreement (the cheap stage's error where it was sure)."""
    metrics, final = services.metrics, ran[-1]
    for stage in ran[:-1]:
        metrics.cascade_escalations.labels(state.name, stage.backend, stage.went_on or "none").inc()
        if stage.went_on == "audit":
            crossed = (stage.score >= state.config.threshold) != (final.score >= state.config.threshold)
            metrics.cascade_audits.labels(state.name, stage.backend, "disagree" if crossed else "agree").inc()
    if len(ran) == 1 and len(state.config.stages) > 1:
        metrics.cascade_escalations.labels(state.name, final.backend, "none").inc()
