"""The operations routes: GET /health (readiness, from the prober's cache), GET /metrics and GET /quality
(the live reward-quality monitor, proxy/quality/)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from proxy.http.error_answers import error_answers
from proxy.http.json_body import JSONBodyRoute
from proxy.http.run_access import runs_of, visible_metrics, visible_quality
from proxy.metrics import Metrics
from proxy.quality.monitor import QualityMonitor
from proxy.upstream.backends import BackendRegistry
from proxy.upstream.health import Prober, endpoint_health

__all__ = ["router"]

router = APIRouter(route_class=JSONBodyRoute)


@router.get("/health", responses={503: {"description": "no backend is ready",
                                        "content": {"application/json": {"schema": {"type": "object"}}}}})
async def health(request: Request) -> JSONResponse:
    """From the prober's cache and the requests' outcomes: no upstream call per request. A backend
    is ready when any of its endpoints passed its last probe (or answered a call since a failed
    one), is in rotation (not draining either), and has not failed a request since. Reasons in
    full only for a caller who may score (proxy/upstream/health.py's endpoint_health); codes for anyone."""
    registry: BackendRegistry = request.app.state.services.registry
    prober: Prober = request.app.state.prober
    detailed = request.state.role is not None or request.app.state.settings.proxy.api_key_env is None
    backends: dict[str, Any] = {}
    for backend in registry.backends.values():
        endpoints = [endpoint_health(endpoint, prober.readiness(backend.name, endpoint.base_url), detailed=detailed)
                     for endpoint in backend.pool.endpoints]
        backends[backend.name] = {"model": backend.config.model, "aliases": backend.config.aliases,
                                  "ready": any(e["ready"] for e in endpoints), "queue": backend.pool.waiting,
                                  "endpoints": endpoints}
    ready = [b["ready"] for b in backends.values()]
    status = "ok" if all(ready) else ("degraded" if any(ready) else "unavailable")
    body: dict[str, Any] = {"status": status, "backends": backends}
    # Files on disk: counts for anyone; paths and OS error text (which name paths) only in detail.
    if request.app.state.services.frame_store is not None:  # kept for the report; never decides readiness
        body["frame_store"] = _detail_only(request.app.state.services.frame_store.status(), detailed, "last_error")
    if request.app.state.services.audit.path is not None:  # lines lost (disk too slow, OS error) are never silent
        body["audit"] = _detail_only(request.app.state.services.audit.status(), detailed, "path", "error")
    # An alarm never makes the proxy unhealthy (it still serves); which keys, only for a caller who may score.
    quality: QualityMonitor = request.app.state.services.quality
    reward_quality = visible_quality(runs_of(request), quality.health())  # a limited key: its runs' alarms
    body["reward_quality"] = reward_quality if detailed else {"status": reward_quality["status"],
                                                             "alarms": len(reward_quality["alarms"])}
    return JSONResponse(body, status_code=200 if any(ready) else 503)


def _detail_only(status: dict[str, Any], detailed: bool, *keys: str) -> dict[str, Any]:
    return status if detailed else {k: v for k, v in status.items() if k not in keys}


@router.get("/metrics", responses={**error_answers(401, 500),
                                   200: {"content": {"text/plain; version=0.0.4; charset=utf-8": {}},
                                         "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    metrics: Metrics = request.app.state.services.metrics
    for backend in request.app.state.services.registry.backends.values():
        metrics.queue_length.labels(backend.name).set(backend.pool.waiting)
        for decision, count in backend.pool.routed.items():
            metrics.routed.labels(backend.name, decision).set(count)
        metrics.observe_endpoints(backend.name, backend.pool.endpoints)
    return Response(visible_metrics(runs_of(request), metrics.render()),
                    media_type="text/plain; version=0.0.4; charset=utf-8")


@router.get("/quality", responses={**error_answers(401), 200: {
    "description": "per (run, backend, task): the window's agreement numbers, its first full window, its status",
    "content": {"application/json": {"schema": {"type": "object"}}}}})
async def quality(request: Request) -> JSONResponse:
    """The live reward-quality monitor: the same numbers as `report`, over the last quality.window
    episodes of each key that carried metadata.env_success (docs/reward-quality.md)."""
    monitor: QualityMonitor = request.app.state.services.quality
    return JSONResponse(visible_quality(runs_of(request), monitor.snapshot()))
