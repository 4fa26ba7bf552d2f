"""How the proxy's own routes read a JSON body without holding the event loop.

FastAPI parses a body with `json.loads` on the loop, and the interpreter lock is held for the whole
parse, so a worker thread does not help (bench/bench_json_body.py). Two measures instead:

- the parse is pydantic-core's (`from_json`, Rust): a 64 MiB body of base64 frames, the largest
  `proxy.max_body_mb` allows, holds the loop ~50 ms instead of ~250 ms;
- a body that holds more JSON values than any valid request could (a huge array of small numbers
  parses at ~40 ms per million values) is refused before the parse: 413 naming the cap. The count
  is of commas, in a worker thread (C speed, ~28 ms for 64 MiB); strings' commas only make it
  larger, and a valid body has at most one value per inline frame and a few dozen fields per item.

Every route module (the *_routes.py beside it) uses `JSONBodyRoute`. The
pass-through relays bytes, reading only its routing fields (proxy/protocol/json_peek.py), and a body
whole only when its bytes could hold a media `uuid` (proxy/pipelines/passthrough.py); a `score:<backend>` chat
body is parsed with the same `loads` (proxy/protocol/json_peek.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from proxy.errors import InvalidRequest, PayloadTooLarge
from proxy.protocol.json_peek import loads

__all__ = ["JSONBodyRoute", "check_content_type", "check_json_values", "max_json_values"]

_SCAN_FROM_BYTES = 1 << 20  # smaller bodies cannot hold enough values to matter
_FIELDS_PER_ITEM = 64  # headroom per batch item for its non-frame fields


def max_json_values(max_inline_frames: int, max_batch_items: int) -> int:
    """More separators than this and no request of any route can be valid."""
    return max_batch_items * (max_inline_frames + _FIELDS_PER_ITEM)


async def check_json_values(raw: bytes, max_values: int) -> None:
    """413 for a body with more values than any valid request (the parse would hold the loop)."""
    if len(raw) >= _SCAN_FROM_BYTES:
        separators = await asyncio.to_thread(raw.count, b",")
        if separators > max_values:
            raise PayloadTooLarge(f"the JSON body holds over {max_values} values, more than any valid request "
                                  "(proxy.max_inline_frames x proxy.max_batch_items): send frames as strings "
                                  "or in the binary body")


def check_content_type(content_type: str | None) -> None:
    """422 naming the content type a body needs: FastAPI reads a body as JSON only when it says so,
    and would otherwise report the bytes as "not a JSON object" (curl -d sends a form type)."""
    media_type = (content_type or "").partition(";")[0].strip().lower()
    if media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json")):
        return
    sent = f"as {media_type!r}" if media_type else "without a content-type"
    raise InvalidRequest(f"the body was sent {sent}: send it with content-type: application/json "
                         "(or multipart/form-data, the binary body)", field="content-type")


class _FastJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                self._json = loads(await self.body())
            except ValueError as err:
                # FastAPI answers this one as its usual 422 json_invalid (the body is not echoed back).
                raise json.JSONDecodeError(str(err), "", 0) from None
        return self._json


class JSONBodyRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def with_fast_json(request: Request) -> Response:
            request = _FastJSONRequest(request.scope, request.receive)
            if request.method == "POST":  # before FastAPI's body reading, which turns any error into a 400
                proxy = request.app.state.settings.proxy
                body = await request.body()
                await check_json_values(body, max_json_values(proxy.max_inline_frames, proxy.max_batch_items))
                if body and self.body_field is not None:
                    check_content_type(request.headers.get("content-type"))
            return await handler(request)

        return with_fast_json
