"""The proxy's routes: thin handlers over the Scorer, the pass-through and the prober."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from proxy.backends import BackendRegistry
from proxy.errors import InvalidRequest
from proxy.health import Prober
from proxy.observe import Metrics
from proxy.passthrough import ChatPassthrough
from proxy.schemas import BatchScoreRequest, ScoreRequest, ScoreResponse
from proxy.scoring import Scorer
from vlm_protocol.wire import BUDGET_HEADER

router = APIRouter()


async def _scorer(request: Request) -> Scorer:  # async: no threadpool hop per request
    return request.app.state.scorer


async def _passthrough(request: Request) -> ChatPassthrough:
    return request.app.state.passthrough


ScorerDep = Annotated[Scorer, Depends(_scorer)]
PassthroughDep = Annotated[ChatPassthrough, Depends(_passthrough)]


def budget_of(request: Request) -> float | None:
    """The caller's remaining budget in seconds (BUDGET_HEADER, milliseconds), if it sent one."""
    raw = request.headers.get(BUDGET_HEADER)
    if raw is None:
        return None
    try:
        budget_ms = float(raw)
    except ValueError:
        budget_ms = math.nan
    if not math.isfinite(budget_ms) or budget_ms <= 0:
        raise InvalidRequest(f"header {BUDGET_HEADER} must be a positive number of milliseconds, got {raw!r}",
                             field=BUDGET_HEADER)
    return budget_ms / 1e3


@router.post("/score", response_model=ScoreResponse)
async def score(body: ScoreRequest, request: Request, scorer: ScorerDep) -> ScoreResponse:
    result = await scorer.score(body, budget_s=budget_of(request))
    request.state.backend = result.backend
    return result


@router.post("/score/batch")
async def score_batch(body: BatchScoreRequest, request: Request, scorer: ScorerDep) -> JSONResponse:
    cap = request.app.state.settings.proxy.max_batch_items
    if len(body.items) > cap:
        raise InvalidRequest(f"{len(body.items)} items is over the batch cap of {cap} (proxy.max_batch_items)",
                             field="items")
    results = await scorer.score_batch(body.items, budget_s=budget_of(request))
    backends = {r["result"]["backend"] for r in results if r["ok"]}
    request.state.backend = backends.pop() if len(backends) == 1 else ("mixed" if backends else "none")
    ok = sum(r["ok"] for r in results)
    return JSONResponse({"results": results, "summary": {"ok": ok, "failed": len(results) - ok}})


@router.get("/v1/models")
async def models(passthrough: PassthroughDep) -> JSONResponse:
    return JSONResponse(passthrough.models())


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, passthrough: PassthroughDep) -> Response:
    body = await request.body()
    relay = asyncio.ensure_future(passthrough.relay(body, budget_s=budget_of(request)))
    gone = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (relay, gone) if not relay.done() else (gone,):
            task.cancel()
        await asyncio.gather(relay, gone, return_exceptions=True)
    if not relay.done() or relay.cancelled():
        # The caller left while vLLM had not answered yet: stop the upstream call (and its slot).
        request.state.error_code = "client_disconnected"
        return Response(status_code=499)
    relayed = relay.result()
    request.state.backend = relayed.backend
    if relayed.stream is not None:
        return relayed.stream
    return Response(relayed.content, status_code=relayed.status_code, media_type=relayed.media_type,
                    headers={"x-upstream-attempts": str(relayed.attempts)})


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """From the prober's cache and the requests' outcomes: no upstream call per request. A backend
    is ready when any of its endpoints passed its last probe, is in rotation, and has not failed
    a request since."""
    registry: BackendRegistry = request.app.state.registry
    prober: Prober = request.app.state.prober
    backends: dict[str, Any] = {}
    for backend in registry.backends.values():
        endpoints = []
        for endpoint in backend.pool.endpoints:
            readiness = prober.readiness(backend.name, endpoint.base_url)
            circuit = endpoint.state()
            # The newest evidence wins: requests that failed since the last good probe or call.
            failing = endpoint.consecutive_failures > 0
            endpoints.append({"url": endpoint.base_url, "in_flight": endpoint.in_flight, "circuit": circuit,
                              **readiness.as_dict(),
                              "ready": readiness.ready and circuit != "open" and not failing,
                              "reason": endpoint.last_failure if failing else readiness.reason})
        backends[backend.name] = {"model": backend.config.model, "aliases": backend.config.aliases,
                                  "ready": any(e["ready"] for e in endpoints), "queue": backend.pool.waiting,
                                  "endpoints": endpoints}
    ready = [b["ready"] for b in backends.values()]
    status = "ok" if all(ready) else ("degraded" if any(ready) else "unavailable")
    return JSONResponse({"status": status, "backends": backends}, status_code=200 if any(ready) else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    for backend in request.app.state.registry.backends.values():
        metrics.queue_length.labels(backend.name).set(backend.pool.waiting)
        for endpoint in backend.pool.endpoints:
            metrics.endpoint_in_flight.labels(backend.name, endpoint.base_url).set(endpoint.in_flight)
            metrics.circuit_open.labels(backend.name, endpoint.base_url).set(int(endpoint.circuit_open))
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
