"""POST /score/dense: one episode's progress curve, from k prefixes scored concurrently on one
decode of the source.

Each prefix is scored as /score would score an episode that ended there (`prefix_end`), so a
PRIMO-R1 prefix is exactly its training input at step t: the first frame, the frames up to t, and
frame t. The source is decoded once at the union of the prefixes' frames, and a frame's JPEG is made
once per size. A curve with a hole is not a curve, so the first point that fails fails the request
(its error names the point) and the others are cancelled. Points are capped by
proxy.max_batch_items, since k points are k calls. Each point writes its own audit line of kind
`dense_point`, placed in its curve by `dense: {point, points, curve}`, so reports never count a
prefix as an episode. A GVL backend (layout shuffled_images) answers the whole curve in one call.
The point that ends at the episode's last frame is marked `dense.episode: true`: it is the one the
live monitor sees, and the one a restart rebuilds the monitor from.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from proxy.config import BackendConfig
from proxy.errors import InvalidRequest, ProxyError
from proxy.media.decode import FrameLimits
from proxy.media.decode_jobs import DEFAULT_POINTS, Curve, CurveJob
from proxy.pipelines.envelope import DENSE_CURVE, DENSE_POINT, Envelope
from proxy.pipelines.episode_frames import LoadedEpisode, describe_frames, source_of, store_frames
from proxy.pipelines.frames_scoring import Prepared
from proxy.pipelines.scoring import SCORE, score_episode
from proxy.pipelines.services import Services
from proxy.prompting.request import resolve_request
from proxy.protocol.dense import CurvePoint, DenseRequest, DenseResponse
from proxy.protocol.score import ScoreRequest, ScoreResponse

__all__ = ["DEFAULT_POINTS", "score_dense"]



async def score_dense(services: Services, request: DenseRequest, *, budget_s: float | None) -> DenseResponse:
    started = time.perf_counter()
    points = len(request.prefix_ends or ()) or request.points or DEFAULT_POINTS
    cap = services.settings.proxy.max_batch_items
    if points > cap:
        raise InvalidRequest(f"{points} points is over the cap of {cap} (proxy.max_batch_items: k points are k calls)",
                             field="prefix_ends" if request.prefix_ends else "points")
    backend = services.registry.resolve(request.backend)
    cfg = backend.config
    template = services.prompts.get(cfg.prompt)
    if template.answer.per_frame:
        return await _score_shuffled(services, request, points, backend.name, budget_s, started)
    limits = resolve_request(request, cfg, template, services.settings.proxy).limits
    metadata = request.metadata.model_dump(exclude_none=True) if request.metadata else None
    with Envelope(services, DENSE_CURVE, backend.name, watch=(request.task_text, metadata)) as curve_envelope:
        return await _score_prefixes(services, request, curve_envelope, limits, budget_s, started)


async def _score_prefixes(services: Services, request: DenseRequest, envelope: Envelope, limits: FrameLimits,
                          budget_s: float | None, started: float) -> DenseResponse:
    """Every prefix from one decode, each point scored as its own /score inside its own envelope."""
    backend = envelope.backend
    # One decode for every prefix, each frame kept only at the sizes its prefixes send (within one
    # request budget), then every prefix's JPEGs: the plan goes as data, the decoded frames stay where
    # they were decoded.
    decoded: Curve = await services.media.run_job(CurveJob(limits, source_of(request, services), request.prefix_ends,
                                                           request.points or DEFAULT_POINTS))
    count, load_ms, ends, encoded = decoded.count, decoded.load_ms, decoded.ends, decoded.frames
    base = request.model_dump(exclude={"points", "prefix_ends"})
    curve = uuid.uuid4().hex[:16]  # names the curve in its points' audit lines (report: VOC per curve)

    # the point that scores the whole episode is the one the monitor sees; its line says so (a restart's rebuild)
    whole = len(ends) - 1 if ends and ends[-1] == count - 1 else None

    def point_task(point: int, end: int) -> asyncio.Future[ScoreResponse]:
        prefix = ScoreRequest.model_validate({**base, "prefix_end": end})

        async def frames_for(prepared: Prepared, cfg: BackendConfig) -> LoadedEpisode:
            return await store_frames(services, describe_frames(prefix, cfg, encoded[point],
                                                                prepared.resolved.requested_nframes))

        return asyncio.ensure_future(score_episode(
            services, prefix, DENSE_POINT, frames_for, budget_s=budget_s,
            described={"dense": {"point": point, "points": len(ends), "curve": curve,
                                 **({"episode": True} if point == whole else {})}}))

    tasks = [point_task(point, end) for point, end in enumerate(ends)]
    try:
        done = await asyncio.gather(*tasks)
    except ProxyError as err:
        point = next((i for i, t in enumerate(tasks) if t.done() and not t.cancelled() and t.exception() is err), None)
        if point is not None:
            err.message = f"point {point + 1} of {len(ends)} (prefix ending at frame {ends[point]}): {err.message}"
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    usage: dict[str, int] = {}
    for result in done:
        for key, value in (result.usage or {}).items():
            if isinstance(value, int):
                usage[key] = usage.get(key, 0) + value
    # the curve's last point scores the whole episode: that is the episode the monitor sees
    watched = envelope.watch_episode(done[-1].score) if whole is not None else None
    return DenseResponse(
        method="prefixes", quality=watched,
        curve=[CurvePoint(frame_index=end, score=r.score, raw_score=r.raw_score)
               for end, r in zip(ends, done, strict=True)],
        points=done, backend=backend.name, model=done[-1].model, source_count=count,
        attempts=sum(r.attempts for r in done), usage=usage,
        timings_ms={"load": round(load_ms, 3), "total": round((time.perf_counter() - started) * 1e3, 3)})


async def _score_shuffled(services: Services, request: DenseRequest, points: int, backend: str,
                          budget_s: float | None, started: float) -> DenseResponse:
    """GVL's one call: the first frame as the reference and `points` frames after it, spread as a
    /score samples nframes = points + 1 (so the points end where the prefix method's would), shown
    shuffled; the reply's values un-shuffled are the curve."""
    if request.prefix_ends is not None:
        raise InvalidRequest("a backend that shows shuffled frames (layout shuffled_images) picks its frames evenly: "
                             "give points, not prefix_ends", field="prefix_ends")
    base = request.model_dump(exclude={"points", "prefix_ends"})
    # an episode, not a prefix: its audit line is a score line and the monitor sees it (the last frame's value)
    result = await score_episode(services, ScoreRequest.model_validate({**base, "nframes": points + 1}), SCORE,
                                 budget_s=budget_s)
    assert result.per_frame is not None
    if len(result.per_frame) < points:
        raise InvalidRequest(f"points {points} is more than the episode's {len(result.per_frame)} frames after its "
                             "first", field="points")
    return DenseResponse(
        method="shuffled", quality=result.quality,
        curve=[CurvePoint(frame_index=p["frame_index"], score=p["score"], raw_score=p["raw_score"])
               for p in result.per_frame],
        points=[result], backend=backend, model=result.model, source_count=result.frames.source_count,
        attempts=result.attempts, usage={k: v for k, v in (result.usage or {}).items() if isinstance(v, int)},
        timings_ms={"load": result.timings_ms["load"],
                    "total": round((time.perf_counter() - started) * 1e3, 3)})
