"""The one error → HTTP mapping: every error answer of the proxy is built here.

Shape: `{"error": {"code", "message", "retryable", "attempts"?, "field"?, "request_id", ...}}`
with the status from vlm_protocol.errors, `x-request-id`, `Retry-After` on every 429/503 and
`Allow` on 405. Framework refusals (unknown route, wrong method, a body that is not JSON or does
not fit the schema) are translated into the same tree; `Edge` answers anything unexpected as
`internal_error`. Each answer notes its code (and backend, when one was resolved) in the
request's scope for the request counter.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from proxy.errors import InvalidRequest, MethodNotAllowed, ProxyError, RouteNotFound
from proxy.protocol.common import ErrorBody, validation_error
from vlm_protocol.wire import REQUEST_ID_HEADER

__all__ = ["error_answers", "error_response", "install_handlers"]


ERROR_MEANINGS = {
    401: "missing or wrong bearer token (proxy.api_key_env)",
    403: "video_path outside the allowed roots; run_forbidden: a key limited to some runs (proxy.run_keys) named "
         "another run, or none (`field` names where)",
    404: "unknown backend",
    409: "frame_rules_changed: the frames were encoded for frame rules the backend no longer has (GET /frame-rules)",
    413: "body over proxy.max_body_mb, or media over a budget (max_decoded_mb, max_video_frames, max_video_seconds)",
    422: "a bad field; `field` names it",
    429: "the backend's admission queue is full (Retry-After)", 500: "a bug (logged with its traceback)",
    502: "vLLM failed, or its replies held no declared answer",
    503: "no replica reachable, or the proxy is shutting down (Retry-After)",
    504: "vLLM did not answer within the deadline (or the caller's budget)"}


def error_answers(*statuses: int, meanings: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give (OpenAPI `responses`), all in the one error shape;
    `meanings` says what a status means on that route where it differs."""
    said = {**ERROR_MEANINGS, **(meanings or {})}
    return {status: {"model": ErrorBody, "description": said[status]} for status in statuses}


def error_response(err: ProxyError, scope: Scope) -> JSONResponse:
    state = scope.setdefault("state", {})
    request_id = state.get("request_id")
    state["error_code"] = err.code
    backend = getattr(err, "backend", None)
    if backend is not None:
        state.setdefault("backend", backend)
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if err.status_code in (429, 503):
        # Always say when to come back; a server's own Retry-After wins when it gave one.
        retry_after = getattr(err, "retry_after_s", None)
        headers["retry-after"] = str(max(1, round(retry_after if retry_after is not None else 1)))
    if isinstance(err, MethodNotAllowed) and err.allow:
        headers["allow"] = err.allow
    return JSONResponse({"error": err.to_dict(request_id)}, status_code=err.status_code, headers=headers)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> str | None:
    """Every method the path takes, asked of the router itself (routes may sit in included routers).
    FastAPI registers one route per method, and the router answers 405 from the first route whose
    path matches, naming that route's methods alone (GET or POST of /admin/endpoints, not both)."""
    methods = [method for method in _METHODS if any(
        route.matches({**request.scope, "method": method})[0] is Match.FULL for route in request.app.router.routes)]
    return ", ".join(methods) or None


def _from_http_exception(exc: StarletteHTTPException, request: Request) -> ProxyError:
    if exc.status_code == 404:
        return RouteNotFound("no such route")
    if exc.status_code == 405:
        headers = exc.headers or {}
        allow = _allowed_methods(request) or headers.get("Allow") or headers.get("allow")
        return MethodNotAllowed("method not allowed on this route" + (f"; allowed: {allow}" if allow else ""),
                                allow=allow)
    # e.g. invalid UTF-8 or nesting too deep for the JSON parser: as bad input as malformed JSON
    return InvalidRequest(f"the request body could not be read: {exc.detail}", field="body")


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> JSONResponse:
        return error_response(exc, request.scope)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(_from_http_exception(exc, request), request.scope)

    @app.exception_handler(RequestValidationError)
    async def schema_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())), request.scope)
