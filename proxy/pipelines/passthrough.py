"""OpenAI-compatible pass-through: /v1/chat/completions routed by `model` to a backend.

The body goes upstream untouched (the model name is rewritten only when an alias was used), except
that a media `uuid` is refused: vLLM takes it as the identity of an image's or video's features
without checking the data (vllm#55547), so a caller could make another's frames — the proxy's own
scoring requests, whose uuids are the JPEGs' sha256 — mean what it chose. So is a media URL other
than `data:` (found by review, stop 36): vLLM fetches http(s) media itself, so a scoring key could
make the model's hosts request any address they can reach (and `file:` URLs, where allowed).
vLLM's answer comes back as it was, streaming included. Retries (same policy as /score) happen
only before the first byte reaches the client: once a stream has started it is relayed as is.
A stream holds its endpoint slot until its last byte, and whatever ends it — the last byte, an
error, or the client going away before or after the first byte — releases the slot and closes
the upstream response (`RelayStream`, sent by the HTTP layer's `RelayedStream`).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pydantic_core

from proxy.errors import InvalidRequest, UpstreamError, UpstreamRejected
from proxy.pipelines.envelope import PASSTHROUGH, Envelope
from proxy.pipelines.services import Services
from proxy.protocol.json_peek import Field, NotJsonObject, peek_fields, splice
from proxy.upstream.backends import Backend
from proxy.upstream.client import UpstreamAnswer, UpstreamStream, translate_status


def refuse_unsafe_media(raw_body: bytes) -> None:
    """A 422 for a body whose messages hold a `uuid` key anywhere, or a url that is not a `data:`
    URL (the module docstring says why). Read whole only when its bytes could spell either — the
    quoted key, a url value not starting "data:" (an escaped one included), or a \\u escape that
    could write them; inline media has none — and a body that cannot be read whole then is refused
    too, never relayed unchecked (vLLM's parser may read what this one could not)."""
    if b'"uuid"' not in raw_body and b"\\u" not in raw_body and all(
            raw_body[m.end():m.end() + 5].lower() == b"data:" for m in _URL_VALUE.finditer(raw_body)):
        return
    try:
        parsed = pydantic_core.from_json(raw_body)
    except ValueError as err:
        raise InvalidRequest(f"the body could not be read whole to check its media (uuids, URLs): {err}",
                             field="messages") from None
    found = _unsafe_media(parsed.get("messages") if isinstance(parsed, dict) else None, "messages")
    if found is None:
        return
    where, why = found
    if why == "uuid":
        raise InvalidRequest(f"{where}: media uuids are not relayed: vLLM takes a uuid as the identity of the "
                             "media's features without checking the data (vllm#55547), so one caller could change "
                             "what another's images mean to the model; send the media without a uuid", field=where)
    raise InvalidRequest(f"{where}: only data: URLs are relayed (the media inline, base64): vLLM would fetch any "
                         "other URL itself, from the model's hosts, for whoever holds a scoring key", field=where)


_MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio", "file")
# A string value of a url key, as its bytes start: read whole unless each one starts "data:" at once
# (an escape in a key or value, \u or \/, means a whole read too: the bytes may spell another URL).
_URL_VALUE = re.compile(rb'"(?:url|image_url|video_url|audio_url)"\s*:\s*"')


def _unsafe_media(root: object, path: str) -> tuple[str, str] | None:
    """Where the first `uuid` key or non-data media URL is, and which (walked with a stack: a deep
    body cannot overflow Python's)."""
    stack = [(root, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            if "uuid" in node:
                return f"{where}.uuid", "uuid"
            # any url in a message (a part's, whatever its type), and a media part given as a bare string
            for key in ("url", *_MEDIA_PARTS):
                url = node.get(key)
                if isinstance(url, str) and not url.lstrip().lower().startswith("data:"):
                    return f"{where}.{key}", "url"
            stack += [(value, f"{where}.{key}") for key, value in reversed(node.items())]
        elif isinstance(node, list):
            stack += [(value, f"{where}.{i}") for i, value in reversed(list(enumerate(node)))]
    return None


@dataclass
class Relayed:
    """An upstream answer to hand back: a whole body, or a stream the caller must send or close."""

    backend: str
    status_code: int
    content: bytes | None
    stream: RelayStream | None
    media_type: str
    attempts: int


@dataclass
class RelayStream:
    """A streamed upstream answer as plain parts: its chunks, and the cleanup (close the upstream
    response, release the endpoint slot) that must run exactly once however the relay ends. The
    HTTP layer wraps it in its response (proxy/http/openai_routes.py's RelayedStream)."""

    chunks: AsyncIterator[bytes]
    cleanup: Callable[[bool], Awaitable[None]]  # called with whether the last chunk was sent


@dataclass(frozen=True)
class RoutingFields:
    """What routing reads of a chat body: `model` (its value and span) and whether it streams."""

    model: Field
    stream: bool


def routing_fields(raw_body: bytes) -> RoutingFields:
    """A chat body's `model` and `stream`, without parsing its megabytes of frames; 422 when the
    body is not one JSON object with a string `model`."""
    try:
        fields = peek_fields(raw_body, _ROUTING)
    except NotJsonObject as err:
        raise InvalidRequest(f"the request body is not valid JSON ({err})", field="body") from err
    model = fields.get("model")
    if model is None or not isinstance(model.value, str):
        raise InvalidRequest("body must be a JSON object with a string 'model'", field="model")
    stream = fields.get("stream")
    if stream is not None and stream.value is not None and not isinstance(stream.value, bool):
        # OpenAI's `stream` is a boolean (or null). vLLM reads "false", 0 or "no" as False in
        # pydantic's lax mode: relaying any of them as a stream would answer what vLLM did not.
        given = stream.value if isinstance(stream.value, bytes) else json.dumps(stream.value).encode()
        raise InvalidRequest(f"'stream' must be true, false or null, not {given[:40].decode('utf-8', 'replace')}",
                             field="stream")
    return RoutingFields(model, stream is not None and stream.value is True)


_ROUTING = frozenset({"model", "stream"})


class ChatPassthrough:
    def __init__(self, services: Services) -> None:
        self.services = services
        self.registry = services.registry

    def models(self) -> dict:
        data = []
        for backend in self.registry.of_kind("chat"):  # an embedding backend serves /progress, not chat
            for label in dict.fromkeys(backend.labels):  # ordered, no repeats
                data.append({"id": label, "object": "model", "owned_by": "vlm-reward-proxy",
                             "root": backend.config.model, "backend": backend.name})
        return {"object": "list", "data": data}

    async def relay(self, raw_body: bytes, request: RoutingFields, *, budget_s: float | None = None) -> Relayed:
        refuse_unsafe_media(raw_body)
        with Envelope(self.services, PASSTHROUGH, request.model.value, field="model") as envelope:
            backend = envelope.backend
            if request.model.value != backend.config.model:  # an alias: vLLM knows the served name only
                raw_body = splice(raw_body, request.model, backend.config.model)
            if request.stream:
                return await self._relay_stream(backend, raw_body, budget_s)
            return await self._relay_whole(backend, raw_body, budget_s)

    async def _relay_whole(self, backend: Backend, body: bytes, budget_s: float | None) -> Relayed:
        forward = functools.partial(self.services.upstream.forward, stream=False)
        response, _, calls = await backend.ask(self.services.metrics, forward, body, budget_s=budget_s,
                                               outcome=_outcome)
        return Relayed(backend.name, response.status_code, response.content, None,
                       response.headers.get("content-type", "application/json"), calls)

    async def _relay_stream(self, backend: Backend, body: bytes, budget_s: float | None) -> Relayed:
        """Hold the endpoint slot until the last byte; retry only while nothing was sent."""
        pool = backend.pool
        forward = functools.partial(self.services.upstream.forward, stream=True)
        (reservation, response), _, calls = await backend.ask_holding_slot(self.services.metrics, forward, body,
                                                                           budget_s=budget_s, outcome=_outcome)
        if isinstance(response, UpstreamAnswer):  # not a 200: forward() read it whole
            pool.release(reservation, ok=True)
            return Relayed(backend.name, response.status_code, response.content, None,
                           response.headers.get("content-type", "application/json"), calls)
        media_type = response.headers.get("content-type", "text/event-stream")

        async def cleanup(finished: bool) -> None:
            try:
                await response.aclose()
            finally:
                pool.release(reservation, ok=finished)

        stream = RelayStream(response.chunks(), cleanup)
        return Relayed(backend.name, 200, None, stream, media_type, calls)


def _outcome(answer: UpstreamAnswer | UpstreamStream) -> str:
    """A 2xx is ok; a 4xx vLLM answered is relayed as is, but counted as what it is."""
    if isinstance(answer, UpstreamAnswer) and answer.status_code >= 400:
        err = translate_status(answer, "")
        return err.code if isinstance(err, UpstreamError) else UpstreamRejected.code
    return "ok"
