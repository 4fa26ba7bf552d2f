"""The binary body (vlm_protocol.multipart) at the edge: a multipart/form-data request becomes its
JSON part for the routes, and its raw parts are what a "part:<name>" frame field reads.

One plain ASGI middleware inside the Edge (so the body cap, auth and request id apply first). The
parts live in a context variable of the request's task (proxy/media/request_parts.py): batch items and worker
threads inherit it, and no other request can name them (a JSON request that says "part:x" finds
nothing: a 422).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.errors import InvalidRequest
from proxy.http.error_answers import error_response
from proxy.media.request_parts import PARTS
from vlm_protocol.multipart import FormError, decode_form, is_form

__all__ = ["BinaryBody"]

class BinaryBody:
    def __init__(self, app: ASGIApp, *, max_parts: int) -> None:
        self.app, self.max_parts = app, max_parts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not is_form(headers.get(b"content-type", b"").decode("latin-1")):
            return await self.app(scope, receive, send)
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            request_json, parts = decode_form(b"".join(chunks), headers[b"content-type"].decode("latin-1"),
                                              max_parts=self.max_parts)
        except FormError as err:
            return await error_response(InvalidRequest(f"the multipart body is malformed: {err}", field="body"),
                                        scope)(scope, receive, send)
        sent = False

        async def json_receive() -> Message:
            nonlocal sent
            if sent:
                return await receive()  # after the body: the disconnect, when it comes
            sent = True
            return {"type": "http.request", "body": request_json, "more_body": False}

        rewritten = [(k, v) for k, v in scope["headers"] if k not in (b"content-type", b"content-length")]
        rewritten += [(b"content-type", b"application/json"), (b"content-length", str(len(request_json)).encode())]
        token = PARTS.set(parts)
        try:
            await self.app({**scope, "headers": rewritten}, json_receive, send)
        finally:
            PARTS.reset(token)
