"""The proxy's routes: thin handlers over the Scorer, the pass-through and the prober."""

from __future__ import annotations

import asyncio
import math
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from proxy.backends import BackendRegistry
from proxy.batch import check_batch_size
from proxy.chat_scoring import completion, model_cards, parse_chat, score_chat, scoring_body
from proxy.compare import Comparer
from proxy.dense import DenseRequest, DenseResponse, score_dense
from proxy.errors import InvalidRequest
from proxy.health import Prober, endpoint_health
from proxy.http_errors import error_answers
from proxy.json_body import JSONBodyRoute
from proxy.observe import Metrics
from proxy.passthrough import ChatPassthrough, routing_fields
from proxy.schemas import (
    BatchCompareRequest,
    BatchCompareResponse,
    BatchScoreRequest,
    BatchScoreResponse,
    CompareRequest,
    CompareResponse,
    ScoreRequest,
    ScoreResponse,
)
from proxy.scoring import Scorer
from vlm_protocol.wire import BUDGET_HEADER

router = APIRouter(route_class=JSONBodyRoute)

_ALWAYS = (401, 500, 503)  # any route but /health: auth, a bug, shutting down
_CHAT_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["model", "messages"],
    "properties": {"model": {"type": "string", "description": "a backend's name, served model name or alias "
                                                             "(relayed to vLLM), or score:<backend> (scored by "
                                                             "the /score pipeline, docs/api.md)"},
                   "messages": {"type": "array", "items": {"type": "object"}},
                   "stream": {"type": ["boolean", "null"]}},  # anything else: 422 (passthrough.py)
    "additionalProperties": True, "description": "an OpenAI chat completion request, relayed to vLLM as is, "
                                                 "or scored when `model` is a scoring model"}}}}
_RELAYED = {"description": "vLLM's own answer, relayed as is (OpenAI error shape)",
            "content": {"application/json": {"schema": {"type": "object"}}}}


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


@router.post("/score", response_model=ScoreResponse,
             responses=error_answers(*_ALWAYS, 403, 404, 413, 422, 429, 502, 504))
async def score(body: ScoreRequest, request: Request, scorer: ScorerDep) -> ScoreResponse:
    result = await scorer.score(body, budget_s=budget_of(request))
    request.state.backend = result.backend
    return result


@router.post("/score/batch", response_model=BatchScoreResponse, responses=error_answers(*_ALWAYS, 413, 422))
async def score_batch(body: BatchScoreRequest, request: Request, scorer: ScorerDep) -> JSONResponse:
    check_batch_size(len(body.items), request.app.state.settings.proxy.max_batch_items)
    return _batch_answer(request, await scorer.score_batch(body.items, budget_s=budget_of(request)))


@router.post("/score/dense", response_model=DenseResponse,
             responses=error_answers(*_ALWAYS, 403, 404, 413, 422, 429, 502, 504))
async def score_dense_route(body: DenseRequest, request: Request, scorer: ScorerDep) -> DenseResponse:
    """One episode's progress curve: `points` prefixes (or `prefix_ends`) scored concurrently, one call each."""
    result = await score_dense(scorer, body, budget_s=budget_of(request))
    request.state.backend = result.backend
    return result


def _batch_answer(request: Request, results: list[dict]) -> JSONResponse:
    backends = {r["result"]["backend"] for r in results if r["ok"]}
    request.state.backend = backends.pop() if len(backends) == 1 else ("mixed" if backends else "none")
    ok = sum(r["ok"] for r in results)
    return JSONResponse({"results": results, "summary": {"ok": ok, "failed": len(results) - ok}})


async def _comparer(request: Request) -> Comparer:
    return request.app.state.comparer


ComparerDep = Annotated[Comparer, Depends(_comparer)]


@router.post("/compare", response_model=CompareResponse,
             responses=error_answers(*_ALWAYS, 403, 404, 413, 422, 429, 502, 504))
async def compare(body: CompareRequest, request: Request, comparer: ComparerDep) -> CompareResponse:
    """Two episodes of one task → RL-VLM-F's label: 0 the first is better, 1 the second, -1 no preference."""
    result = await comparer.compare(body, budget_s=budget_of(request))
    request.state.backend = result.backend
    return result


@router.post("/compare/batch", response_model=BatchCompareResponse, responses=error_answers(*_ALWAYS, 413, 422))
async def compare_batch(body: BatchCompareRequest, request: Request, comparer: ComparerDep) -> JSONResponse:
    check_batch_size(len(body.items), request.app.state.settings.proxy.max_batch_items)
    return _batch_answer(request, await comparer.compare_batch(body.items, budget_s=budget_of(request)))


@router.get("/v1/models", responses=error_answers(*_ALWAYS))
async def models(passthrough: PassthroughDep) -> JSONResponse:
    listed = passthrough.models()
    listed["data"] += model_cards(passthrough.registry)  # score:<backend>, chat_scoring.py
    return JSONResponse(listed)


@router.post("/v1/chat/completions", openapi_extra={"requestBody": _CHAT_BODY},
             responses={**error_answers(*_ALWAYS, 404, 413, 422, 429, 502, 504),
                        200: {"description": "the completion, or a text/event-stream when stream is true",
                              "content": {"application/json": {}, "text/event-stream": {}}},
                        400: _RELAYED})
async def chat_completions(request: Request, passthrough: PassthroughDep, scorer: ScorerDep) -> Response:
    body = await request.body()
    fields = routing_fields(body)
    scoring = scoring_body(body, fields.model.value)
    if scoring is not None:  # score:<backend>: the /score pipeline, answered as a chat.completion
        chat = parse_chat(scoring, scorer.registry)
        result = await score_chat(chat, scorer, budget_s=budget_of(request))
        request.state.backend = result.backend
        return JSONResponse(completion(chat, result, request.state.request_id),
                            headers={"x-upstream-attempts": str(result.attempts)})
    relay = asyncio.ensure_future(passthrough.relay(body, fields, budget_s=budget_of(request)))
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


@router.get("/health", responses={503: {"description": "no backend is ready",
                                        "content": {"application/json": {"schema": {"type": "object"}}}}})
async def health(request: Request) -> JSONResponse:
    """From the prober's cache and the requests' outcomes: no upstream call per request. A backend
    is ready when any of its endpoints passed its last probe (or answered a call since a failed
    one), is in rotation (not draining either), and has not failed a request since. Reasons in
    full only for a caller who may score (proxy/health.py's endpoint_health); codes for anyone."""
    registry: BackendRegistry = request.app.state.registry
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
    if request.app.state.frame_store is not None:  # kept for the report; never decides readiness
        body["frame_store"] = _detail_only(request.app.state.frame_store.status(), detailed, "last_error")
    if request.app.state.audit.path is not None:  # lines lost (disk too slow, OS error) are never silent
        body["audit"] = _detail_only(request.app.state.audit.status(), detailed, "path", "error")
    return JSONResponse(body, status_code=200 if any(ready) else 503)


def _detail_only(status: dict[str, Any], detailed: bool, *keys: str) -> dict[str, Any]:
    return status if detailed else {k: v for k, v in status.items() if k not in keys}


@router.get("/metrics", responses={**error_answers(401, 500),
                                   200: {"content": {"text/plain; version=0.0.4; charset=utf-8": {}},
                                         "description": "Prometheus text format"}})
async def metrics(request: Request) -> Response:
    metrics: Metrics = request.app.state.metrics
    for backend in request.app.state.registry.backends.values():
        metrics.queue_length.labels(backend.name).set(backend.pool.waiting)
        for decision, count in backend.pool.routed.items():
            metrics.routed.labels(backend.name, decision).set(count)
        metrics.observe_endpoints(backend.name, backend.pool.endpoints)
    return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
