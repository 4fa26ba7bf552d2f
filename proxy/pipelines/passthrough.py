"""OpenAI-compatible pass-through: /v1/chat/completions routed by `model` to a backend.

The body goes upstream untouched (the model name is rewritten only when an alias was used), except
that a media `uuid` is refused: vLLM takes it as the identity of an image's or video's features
without checking the data (vllm#55547), so a caller could make another's frames — the proxy's own
scoring requests, whose uuids are the JPEGs' sha256 — mean what it chose. So is a media URL other
than `data:` (found by review, stop 36): vLLM fetches http(s) media itself, so a scoring key could
make the model's hosts request any address they can reach (and `file:` URLs, where allowed).
What a relayed request can make vLLM process is bounded by the backend's caps (`RelayCaps`: the
most frames and pixels the proxy's own scoring requests send it), since its servers decode a
`data:` video whole (`--media-io-kwargs num_frames -1`) and take per-request processor sizes
(`--trust-request-mm-kwargs`): a video part is a frame list (`data:video/jpeg;base64,<f1>,<f2>,…`,
the form the proxy sends) of at most the frame cap, `mm_processor_kwargs` and `media_io_kwargs`
hold only the sizes and rates below their caps, and a body with media but no `max_pixels` gets
the cap added (said in the answer's RELAY_BOUND_HEADER). Anything else is a 422 naming its
field, before any replica sees it. Image-only bodies keep the fast path: only a body that could
hold a video part is parsed whole.
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
from typing import Any

import pydantic_core

from proxy.config import BackendConfig, ProxySettings
from proxy.errors import InvalidRequest, UpstreamError, UpstreamRejected
from proxy.pipelines.envelope import PASSTHROUGH, Envelope
from proxy.pipelines.services import Services
from proxy.protocol.json_peek import Field, NotJsonObject, peek_fields, splice
from proxy.upstream.backends import Backend
from proxy.upstream.client import UpstreamAnswer, UpstreamStream, translate_status


@dataclass(frozen=True)
class Video:
    """A video part of a relayed body: where its url is, and how many frames it lists (None: not a
    frame list, so vLLM would decode it as a container)."""

    where: str
    frames: int | None


def refuse_unsafe_media(raw_body: bytes) -> list[Video]:
    """A 422 for a body whose messages hold a `uuid` key anywhere, or a url that is not a `data:`
    URL (the module docstring says why); the body's video parts, for `RelayCaps.check`. Read whole
    only when its bytes could spell any of them — the quoted key, a url value not starting "data:"
    (an escaped one included), a video part, or a \\u escape that could write them; image-only
    media has none — and a body that cannot be read whole then is refused too, never relayed
    unchecked (vLLM's parser may read what this one could not)."""
    if b'"uuid"' not in raw_body and b"\\u" not in raw_body and b'"video_url"' not in raw_body and all(
            raw_body[m.end():m.end() + 5].lower() == b"data:" for m in _URL_VALUE.finditer(raw_body)):
        return []
    try:
        parsed = pydantic_core.from_json(raw_body)
    except ValueError as err:
        raise InvalidRequest(f"the body could not be read whole to check its media (uuids, URLs): {err}",
                             field="messages") from None
    videos: list[Video] = []
    found = _unsafe_media(parsed.get("messages") if isinstance(parsed, dict) else None, "messages", videos)
    if found is None:
        return videos
    where, why = found
    if why == "uuid":
        raise InvalidRequest(f"{where}: media uuids are not relayed: vLLM takes a uuid as the identity of the "
                             "media's features without checking the data (vllm#55547), so one caller could change "
                             "what another's images mean to the model; send the media without a uuid", field=where)
    raise InvalidRequest(f"{where}: only data: URLs are relayed (the media inline, base64): vLLM would fetch any "
                         "other URL itself, from the model's hosts, for whoever holds a scoring key", field=where)


_FRAME_LIST = "data:video/jpeg;base64,"  # the comma after base64 and one between frames: commas = frames
_MEDIA_PARTS = ("image_url", "video_url", "audio_url", "input_audio", "file")
# A string value of a url key, as its bytes start: read whole unless each one starts "data:" at once
# (an escape in a key or value, \u or \/, means a whole read too: the bytes may spell another URL).
_URL_VALUE = re.compile(rb'"(?:url|image_url|video_url|audio_url)"\s*:\s*"')


def _unsafe_media(root: object, path: str, videos: list[Video]) -> tuple[str, str] | None:
    """Where the first `uuid` key or non-data media URL is, and which (walked with a stack: a deep
    body cannot overflow Python's); each video part's url is added to `videos` on the way."""
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
            video = node.get("video_url")
            url = video.get("url") if isinstance(video, dict) else video
            if isinstance(url, str):
                field = f"{where}.video_url" + (".url" if isinstance(video, dict) else "")
                # vLLM splits only video/jpeg on commas; any other type it decodes as a container, whole
                videos.append(Video(field, url.count(",") if url.startswith(_FRAME_LIST) else None))
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
    bound: str | None = None  # what the proxy added to the body to keep it within the caps (RELAY_BOUND_HEADER)


@dataclass
class RelayStream:
    """A streamed upstream answer as plain parts: its chunks, and the cleanup (close the upstream
    response, release the endpoint slot) that must run exactly once however the relay ends. The
    HTTP layer wraps it in its response (proxy/http/openai_routes.py's RelayedStream)."""

    chunks: AsyncIterator[bytes]
    cleanup: Callable[[bool], Awaitable[None]]  # called with whether the last chunk was sent


RELAY_BOUND_HEADER = "x-vlm-proxy-bound"  # what the proxy added to a relayed body: mm_processor_kwargs.max_pixels=N
_IO_VIDEO_KEYS = frozenset({"num_frames", "fps"})


@dataclass(frozen=True)
class RelayCaps:
    """What one relayed request may make a backend process: the most its own scoring requests send."""

    frames: int  # frames of one video: frames.clamp_nframes_to, else proxy.nframes_limit
    max_pixels: int  # pixels of one frame or image as the processor sizes it: proxy.max_pixels_limit,
    # at most frames.video_max_pixels
    add_max_pixels: bool  # the backend takes per-request kwargs (request_mm_kwargs): a cap can be sent

    @classmethod
    def of(cls, cfg: BackendConfig, proxy: ProxySettings) -> RelayCaps:
        return cls(frames=cfg.frames.clamp_nframes_to or proxy.nframes_limit,
                   max_pixels=min(proxy.max_pixels_limit, cfg.frames.video_max_pixels),
                   add_max_pixels=cfg.request_mm_kwargs)

    def check(self, videos: list[Video], request: RoutingFields) -> None:
        """A 422 naming the first video part, or processor or loader setting, beyond the caps."""
        for video in videos:
            if video.frames is None:
                raise InvalidRequest(f"{video.where}: a video is relayed as a frame list ({_FRAME_LIST}<f1>,<f2>,…), "
                                     "as the proxy sends one: vLLM would decode any other video whole, every frame, "
                                     "however long", field=video.where)
            if video.frames > self.frames:
                raise InvalidRequest(f"{video.where}: {video.frames} frames, over the backend's cap of {self.frames} "
                                     "(frames.clamp_nframes_to, else proxy.nframes_limit); sample the episode first",
                                     field=video.where)
        if request.mm_processor_kwargs is not None:
            self._check_processor(_object(request.mm_processor_kwargs, "mm_processor_kwargs"))
        if request.media_io_kwargs is not None:
            self._check_loader(_object(request.media_io_kwargs, "media_io_kwargs"))

    def _check_processor(self, kwargs: dict[str, Any]) -> None:
        for key in kwargs:
            if key not in ("max_pixels", "min_pixels"):
                raise InvalidRequest(f"mm_processor_kwargs.{key}: the pass-through relays only max_pixels and "
                                     "min_pixels (each frame's size, within the backend's cap)",
                                     field=f"mm_processor_kwargs.{key}")
        if "max_pixels" not in kwargs:
            raise InvalidRequest(f"mm_processor_kwargs.max_pixels: required with mm_processor_kwargs (at most "
                                 f"{self.max_pixels}): without it the model's own default would size the frames",
                                 field="mm_processor_kwargs.max_pixels")
        for key, value in kwargs.items():
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= self.max_pixels:
                raise InvalidRequest(f"mm_processor_kwargs.{key}: must be an integer from 1 to the backend's cap "
                                     f"of {self.max_pixels} pixels a frame, got {value!r}",
                                     field=f"mm_processor_kwargs.{key}")

    def _check_loader(self, kwargs: dict[str, Any]) -> None:
        for key, value in kwargs.items():
            if key != "video":
                raise InvalidRequest(f"media_io_kwargs.{key}: the pass-through relays only media_io_kwargs.video",
                                     field=f"media_io_kwargs.{key}")
            for name, setting in _object(value, "media_io_kwargs.video").items():
                where = f"media_io_kwargs.video.{name}"
                if name not in _IO_VIDEO_KEYS:
                    raise InvalidRequest(f"{where}: the pass-through relays only num_frames and fps", field=where)
                number = not isinstance(setting, bool) and isinstance(setting, int | float)
                if name == "num_frames" and not (number and isinstance(setting, int) and 1 <= setting <= self.frames):
                    raise InvalidRequest(f"{where}: must be an integer from 1 to the backend's cap of {self.frames} "
                                         f"frames, got {setting!r}", field=where)
                if name == "fps" and not (number and setting > 0):
                    raise InvalidRequest(f"{where}: must be a positive number, got {setting!r}", field=where)

    def bounded(self, raw_body: bytes, request: RoutingFields) -> tuple[bytes, str | None]:
        """The body with mm_processor_kwargs.max_pixels at the cap added when it has media and none
        (so the model's default sizes cannot pass the cap), and what was added; else as it was."""
        if not self.add_max_pixels or request.mm_processor_kwargs is not None or not _MEDIA.search(raw_body):
            return raw_body, None
        opening = raw_body.index(b"{") + 1  # routing read it as one object with a model: never empty
        added = f'"mm_processor_kwargs":{{"max_pixels":{self.max_pixels}}},'.encode()
        return raw_body[:opening] + added + raw_body[opening:], f"mm_processor_kwargs.max_pixels={self.max_pixels}"


_MEDIA = re.compile(rb'"(?:image_url|video_url)"|\\u')  # a media part, or an escape that could spell one


def _object(field: Field | Any, where: str) -> dict[str, Any]:
    """A kwargs value as an object (peek_fields gives an object's raw text), or a 422 naming it."""
    value = field.value if isinstance(field, Field) else field
    if isinstance(value, bytes):
        try:
            value = pydantic_core.from_json(value)
        except ValueError:
            value = None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{where}: must be an object", field=where)
    return value


@dataclass(frozen=True)
class RoutingFields:
    """What routing reads of a chat body: `model` (its value and span), whether it streams, and the
    per-request media settings the backend's caps bound."""

    model: Field
    stream: bool
    mm_processor_kwargs: Field | None = None
    media_io_kwargs: Field | None = None


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
    return RoutingFields(model, stream is not None and stream.value is True,
                         fields.get("mm_processor_kwargs"), fields.get("media_io_kwargs"))


_ROUTING = frozenset({"model", "stream", "mm_processor_kwargs", "media_io_kwargs"})


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
        videos = refuse_unsafe_media(raw_body)
        with Envelope(self.services, PASSTHROUGH, request.model.value, field="model") as envelope:
            backend = envelope.backend
            caps = RelayCaps.of(backend.config, self.services.settings.proxy)
            caps.check(videos, request)
            if request.model.value != backend.config.model:  # an alias: vLLM knows the served name only
                raw_body = splice(raw_body, request.model, backend.config.model)
            raw_body, bound = caps.bounded(raw_body, request)  # after the splice: its span is the original's
            if bound is not None:
                self.services.metrics.relay_bounded.labels(backend.name).inc()
            relayed = await (self._relay_stream if request.stream else self._relay_whole)(backend, raw_body, budget_s)
            relayed.bound = bound
            return relayed

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
