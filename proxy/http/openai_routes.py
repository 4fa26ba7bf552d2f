"""The OpenAI surface: GET /v1/models and POST /v1/chat/completions — relayed to vLLM by the
pass-through, or scored by the /score pipeline when `model` is `score:<backend>`. The one
Starlette-specific piece of a relayed stream (its response object) lives here too."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from proxy.http.deps import ALWAYS, ServicesDep, budget_of
from proxy.http.error_answers import error_answers
from proxy.http.json_body import JSONBodyRoute
from proxy.http.run_access import check_writes
from proxy.pipelines.chat_scoring import completion, model_cards, parse_chat, score_chat, scoring_body
from proxy.pipelines.passthrough import RELAY_BOUND_HEADER, ChatPassthrough, RelayStream, routing_fields

__all__ = ["router"]

router = APIRouter(route_class=JSONBodyRoute)

_CHAT_BODY = {"required": True, "content": {"application/json": {"schema": {
    "type": "object", "required": ["model", "messages"],
    "properties": {"model": {"type": "string", "description": "a backend's name, served model name or alias "
                                                             "(relayed to vLLM), or score:<backend> (scored by "
                                                             "the /score pipeline, docs/api.md)"},
                   "messages": {"type": "array", "items": {"type": "object"}},
                   "stream": {"type": ["boolean", "null"]}},  # anything else: 422 (proxy/pipelines/passthrough.py)
    "additionalProperties": True, "description": "an OpenAI chat completion request, relayed to vLLM as is, "
                                                 "or scored when `model` is a scoring model"}}}}
_RELAYED = {"description": "vLLM's own answer, relayed as is (OpenAI error shape)",
            "content": {"application/json": {"schema": {"type": "object"}}}}


async def _passthrough(request: Request) -> ChatPassthrough:
    return request.app.state.passthrough


PassthroughDep = Annotated[ChatPassthrough, Depends(_passthrough)]


@router.get("/v1/models", responses=error_answers(*ALWAYS))
async def models(passthrough: PassthroughDep) -> JSONResponse:
    listed = passthrough.models()
    listed["data"] += model_cards(passthrough.registry)  # score:<backend>, proxy/pipelines/chat_scoring.py
    return JSONResponse(listed)


@router.post("/v1/chat/completions", openapi_extra={"requestBody": _CHAT_BODY},
             responses={**error_answers(*ALWAYS, 403, 404, 413, 422, 429, 502, 504),
                        200: {"description": "the completion, or a text/event-stream when stream is true",
                              "content": {"application/json": {}, "text/event-stream": {}}},
                        400: _RELAYED})
async def chat_completions(request: Request, passthrough: PassthroughDep, services: ServicesDep) -> Response:
    body = await request.body()
    fields = routing_fields(body)
    scoring = scoring_body(body, fields.model.value)
    if scoring is not None:  # score:<backend>: the /score pipeline, answered as a chat.completion
        chat = parse_chat(scoring, services.registry)
        metadata = chat.request.metadata
        check_writes(request, [("metadata.run", metadata.run if metadata is not None else None)])
        result = await score_chat(chat, services, budget_s=budget_of(request))
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
    headers = {"x-upstream-attempts": str(relayed.attempts),
               **({RELAY_BOUND_HEADER: relayed.bound} if relayed.bound is not None else {})}
    if relayed.stream is not None:
        return RelayedStream(relayed.stream, media_type=relayed.media_type, headers=headers)
    return Response(relayed.content, status_code=relayed.status_code, media_type=relayed.media_type,
                    headers=headers)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: receive() waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RelayedStream(StreamingResponse):
    """A streamed upstream answer whose cleanup runs exactly once, however the relay ends —
    also when the client disconnects before the body iterator was ever started (an async
    generator that never ran would never reach its `finally`)."""

    def __init__(self, relay: RelayStream, **kwargs) -> None:
        self._finished = False
        self._cleanup, self._cleaned = relay.cleanup, False

        async def chunks() -> AsyncIterator[bytes]:
            async for chunk in relay.chunks:
                yield chunk
            self._finished = True

        super().__init__(chunks(), **kwargs)

    async def close(self) -> None:
        if not self._cleaned:
            self._cleaned = True
            try:
                with contextlib.suppress(RuntimeError):  # never started, or already closed
                    await self.body_iterator.aclose()
            finally:
                await self._cleanup(self._finished)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()
