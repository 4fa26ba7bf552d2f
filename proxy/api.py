"""FastAPI app factory: routes, the one error → HTTP mapping, lifespan-owned resources."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.backends import BackendRegistry
from proxy.config import Settings
from proxy.errors import (
    ConfigError,
    InvalidRequest,
    MethodNotAllowed,
    PayloadTooLarge,
    ProxyError,
    RouteNotFound,
    Unauthorized,
)
from proxy.observe import AuditLog, Metrics
from proxy.passthrough import ChatPassthrough
from proxy.prompts import PromptStore
from proxy.schemas import BatchScoreRequest, ScoreRequest, ScoreResponse, validation_error
from proxy.scoring import Scorer
from proxy.upstream import UpstreamClient

log = logging.getLogger("vlm_reward_proxy")


def error_response(err: ProxyError, request_id: str | None) -> JSONResponse:
    headers = {"x-request-id": request_id} if request_id else {}
    if err.status_code in (429, 503):
        # Always say when to come back; a server's own Retry-After wins when it gave one.
        retry_after = getattr(err, "retry_after_s", None)
        headers["retry-after"] = str(max(1, round(retry_after if retry_after is not None else 1)))
    return JSONResponse({"error": err.to_dict(request_id)}, status_code=err.status_code, headers=headers)


def request_id_of(headers: dict[bytes, bytes] | None) -> str:
    given = (headers or {}).get(b"x-request-id")
    return given.decode("latin-1")[:64] if given else uuid.uuid4().hex[:16]


def _http_exception(exc: StarletteHTTPException) -> ProxyError:
    """Starlette's own refusals (unparseable body, unknown route, wrong method) in our shape."""
    if exc.status_code == 404:
        return RouteNotFound("no such route")
    if exc.status_code == 405:
        return MethodNotAllowed("method not allowed on this route")
    # e.g. invalid UTF-8 or nesting too deep for the JSON parser: as bad input as malformed JSON
    return InvalidRequest(f"the request body could not be read: {exc.detail}", field="body")


class BodySizeLimit:
    """Refuse bodies over the cap before reading them (Content-Length) or while they stream in.

    A streamed (chunked) body that crosses the cap gets the 413 from here; the app then sees a
    disconnect and whatever it tries to send is dropped."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = request_id_of(headers)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(self._too_large(), request_id)(scope, receive, send)
        seen, refused, started = 0, False, False

        async def guarded_send(message) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def limited_receive():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes and not started:
                await error_response(self._too_large(), request_id)(scope, receive, send)
                refused = True
                return {"type": "http.disconnect"}
            return message

        await self.app(scope, limited_receive, guarded_send)

    def _too_large(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body is over the {self.max_bytes / 2**20:g} MiB cap (proxy.max_body_mb)")


def get_scorer(request: Request) -> Scorer:
    return request.app.state.scorer


def get_passthrough(request: Request) -> ChatPassthrough:
    return request.app.state.passthrough


ScorerDep = Annotated[Scorer, Depends(get_scorer)]
PassthroughDep = Annotated[ChatPassthrough, Depends(get_passthrough)]
OPEN_PATHS = frozenset({"/health"})  # reachable without the bearer token (load balancers, `up`)


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
        # One pool for every upstream call; per-call timeouts come from each backend's config.
        async with httpx.AsyncClient(
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
            timeout=httpx.Timeout(120.0, connect=5.0),
            trust_env=False,  # upstreams are addressed directly; env proxies would reroute them
        ) as http:
            metrics = Metrics()
            upstream = UpstreamClient(http)
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

    @app.middleware("http")
    async def request_id_and_auth(request: Request, call_next):
        request.state.request_id = request_id_of(dict(request.scope.get("headers") or []))
        if api_key and request.url.path not in OPEN_PATHS:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(Unauthorized("missing or wrong bearer token"), request.state.request_id)
        response = await call_next(request)
        response.headers.setdefault("x-request-id", request.state.request_id)
        return response

    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return error_response(exc, getattr(request.state, "request_id", None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(_http_exception(exc), getattr(request.state, "request_id", None))

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

    app.add_middleware(BodySizeLimit, max_bytes=int(settings.proxy.max_body_mb * 2**20))
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
