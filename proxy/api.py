"""FastAPI app factory: routes, the one error → HTTP mapping, lifespan-owned resources."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.backends import BackendRegistry
from proxy.config import Settings
from proxy.edge import Edge, error_response, http_exception_error
from proxy.errors import (
    ConfigError,
    InvalidRequest,
    ProxyError,
)
from proxy.observe import AuditLog, Metrics
from proxy.passthrough import ChatPassthrough
from proxy.prompts import PromptStore
from proxy.schemas import BatchScoreRequest, ScoreRequest, ScoreResponse, validation_error
from proxy.scoring import Scorer
from proxy.upstream import UpstreamClient, open_http_clients

log = logging.getLogger("vlm_reward_proxy")


async def get_scorer(request: Request) -> Scorer:  # async: no threadpool hop per request
    return request.app.state.scorer


async def get_passthrough(request: Request) -> ChatPassthrough:
    return request.app.state.passthrough


ScorerDep = Annotated[Scorer, Depends(get_scorer)]
PassthroughDep = Annotated[ChatPassthrough, Depends(get_passthrough)]


async def _health_loop(registry: BackendRegistry, upstream: UpstreamClient, interval_s: float,
                       timeout_s: float) -> None:
    """Probe every endpoint in the background so dead replicas leave and recovered ones return."""
    while True:
        for backend in registry.backends.values():
            results = await asyncio.gather(*(upstream.check(e, backend.config.model, timeout_s)
                                             for e in backend.pool.endpoints))
            for endpoint, result in zip(backend.pool.endpoints, results, strict=True):
                backend.pool.record_probe(endpoint, result)
        await asyncio.sleep(interval_s)


def create_app(settings: Settings) -> FastAPI:
    prompts = PromptStore(settings.proxy.prompts_dir)
    for name, backend in settings.backends.items():
        try:
            prompts.get(backend.prompt)
        except ProxyError as err:
            raise ConfigError(f"backends.{name}.prompt: {err.message}") from err
    for warning in settings.warnings():
        log.warning(warning)
    api_key = settings.proxy_api_key()
    if settings.proxy.api_key_env and not api_key:
        raise ConfigError(f"proxy.api_key_env names {settings.proxy.api_key_env!r}, which is unset or empty")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            clients = [await stack.enter_async_context(c) for c in open_http_clients()]
            metrics = Metrics()
            upstream = UpstreamClient(clients)
            registry = BackendRegistry(settings)
            app.state.settings = settings
            app.state.metrics = metrics
            app.state.registry = registry
            app.state.upstream = upstream
            app.state.scorer = Scorer(settings, registry, prompts, upstream, metrics,
                                      AuditLog(settings.proxy.audit_log))
            app.state.passthrough = ChatPassthrough(registry, upstream, metrics)
            prober = asyncio.create_task(_health_loop(
                registry, upstream, settings.proxy.health_interval_s, settings.proxy.health_timeout_s))
            try:
                yield
            finally:
                prober.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await prober

    app = FastAPI(title="VLM Reward Proxy", version="0.1.0", lifespan=lifespan)

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return error_response(exc, getattr(request.state, "request_id", None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(http_exception_error(exc), getattr(request.state, "request_id", None))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc.errors()), getattr(request.state, "request_id", None))

    @app.post("/score", response_model=ScoreResponse)
    async def score(body: ScoreRequest, scorer: ScorerDep) -> ScoreResponse:
        return await scorer.score(body)

    @app.post("/score/batch")
    async def score_batch(body: BatchScoreRequest, scorer: ScorerDep) -> JSONResponse:
        if len(body.items) > settings.proxy.max_batch_items:
            raise InvalidRequest(f"{len(body.items)} items is over the batch cap of "
                                 f"{settings.proxy.max_batch_items} (proxy.max_batch_items)", field="items")
        results = await scorer.score_batch(body.items)
        ok = sum(r["ok"] for r in results)
        return JSONResponse({"results": results, "summary": {"ok": ok, "failed": len(results) - ok}})

    @app.get("/v1/models")
    async def models(passthrough: PassthroughDep) -> JSONResponse:
        return JSONResponse(passthrough.models())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, passthrough: PassthroughDep) -> Response:
        relayed = await passthrough.relay(await request.body())
        headers = {"x-upstream-attempts": str(relayed.attempts)}
        if relayed.stream is not None:
            return StreamingResponse(relayed.stream, media_type=relayed.media_type, headers=headers)
        return Response(relayed.content, status_code=relayed.status_code, media_type=relayed.media_type,
                        headers=headers)

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        return await _health(request.app)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        metrics: Metrics = request.app.state.metrics
        for backend in request.app.state.registry.backends.values():
            metrics.queue_length.labels(backend.name).set(backend.pool.waiting)
            for endpoint in backend.pool.endpoints:
                metrics.endpoint_in_flight.labels(backend.name, endpoint.base_url).set(endpoint.in_flight)
                metrics.circuit_open.labels(backend.name, endpoint.base_url).set(int(endpoint.circuit_open))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    app.add_middleware(Edge, max_bytes=int(settings.proxy.max_body_mb * 2**20), api_key=api_key)
    return app


async def _health(app: FastAPI) -> JSONResponse:
    """Proxy is up; each backend is ready when any endpoint's /health and /v1/models say so."""
    settings: Settings = app.state.settings
    registry: BackendRegistry = app.state.registry
    upstream: UpstreamClient = app.state.upstream
    timeout = settings.proxy.health_timeout_s
    checks = [(b, e) for b in registry.backends.values() for e in b.pool.endpoints]
    results = await asyncio.gather(*(upstream.check(e, b.config.model, timeout) for b, e in checks))
    backends: dict[str, Any] = {}
    for (backend, endpoint), result in zip(checks, results, strict=True):
        entry = backends.setdefault(backend.name, {"model": backend.config.model,
                                                   "aliases": backend.config.aliases, "ready": False,
                                                   "queue": backend.pool.waiting, "endpoints": []})
        entry["endpoints"].append({"url": endpoint.base_url, "in_flight": endpoint.in_flight,
                                   "circuit": endpoint.state(), **result})
        entry["ready"] = entry["ready"] or result["ready"]
    ready = [b["ready"] for b in backends.values()]
    status = "ok" if all(ready) else ("degraded" if any(ready) else "unavailable")
    return JSONResponse({"status": status, "backends": backends}, status_code=200 if any(ready) else 503)
