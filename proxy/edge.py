"""The HTTP edge, as one plain ASGI middleware, plus the one error → HTTP mapping.

Every request gets a request id (the caller's x-request-id or a new one) on its response and
in any error body; a bearer token is checked when configured (all routes but /health); bodies
over the cap are refused before they are read (Content-Length) or as soon as a streamed body
crosses it. Plain ASGI rather than @app.middleware("http"): that wrapper cost ~10% of the
pass-through's CPU at c=32 (bench/profile_proxy.py).
"""

from __future__ import annotations

import hmac
import uuid

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from proxy.errors import InvalidRequest, MethodNotAllowed, PayloadTooLarge, ProxyError, RouteNotFound, Unauthorized

OPEN_PATHS = frozenset({"/health"})  # reachable without the bearer token (load balancers, `up`)


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


def http_exception_error(exc: StarletteHTTPException) -> ProxyError:
    """Starlette's own refusals (unparseable body, unknown route, wrong method) in our shape."""
    if exc.status_code == 404:
        return RouteNotFound("no such route")
    if exc.status_code == 405:
        return MethodNotAllowed("method not allowed on this route")
    # e.g. invalid UTF-8 or nesting too deep for the JSON parser: as bad input as malformed JSON
    return InvalidRequest(f"the request body could not be read: {exc.detail}", field="body")


class Edge:
    """Request id, bearer token, body cap. A streamed body that crosses the cap gets the 413
    from here; the app then sees a disconnect and whatever it tries to send is dropped."""

    def __init__(self, app, max_bytes: int, api_key: str | None = None) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = request_id_of(headers)
        scope.setdefault("state", {})["request_id"] = request_id  # read back as request.state
        if self.expected_auth and scope["path"] not in OPEN_PATHS and not hmac.compare_digest(
                headers.get(b"authorization", b""), self.expected_auth):
            return await error_response(Unauthorized("missing or wrong bearer token"), request_id)(
                scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await error_response(self._too_large(), request_id)(scope, receive, send)
        seen, refused, started = 0, False, False
        id_header = (b"x-request-id", request_id.encode("latin-1"))

        async def guarded_send(message) -> None:
            nonlocal started
            if refused:
                return
            if message["type"] == "http.response.start":
                started = True
                if not any(k.lower() == b"x-request-id" for k, _ in message.get("headers", ())):
                    message = {**message, "headers": [*message.get("headers", ()), id_header]}
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


