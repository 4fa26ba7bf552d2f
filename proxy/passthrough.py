"""OpenAI-compatible pass-through: /v1/chat/completions routed by `model` to a backend.

The body goes upstream untouched (the model name is rewritten only when an alias was used);
vLLM's answer comes back as it was, streaming included. Retries (same policy as /score) happen
only before the first byte reaches the client: once a stream has started it is relayed as is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from proxy.backends import Backend, BackendRegistry
from proxy.errors import InvalidRequest, UpstreamError
from proxy.observe import Metrics
from proxy.retry import Attempt, call_with_retries
from proxy.upstream import UpstreamClient


@dataclass
class Relayed:
    """An upstream answer to hand back: a whole body, or a stream the caller must drain/close."""

    status_code: int
    content: bytes | None
    stream: AsyncIterator[bytes] | None
    media_type: str
    attempts: int


class ChatPassthrough:
    def __init__(self, registry: BackendRegistry, upstream: UpstreamClient, metrics: Metrics) -> None:
        self.registry = registry
        self.upstream = upstream
        self.metrics = metrics

    def models(self) -> dict:
        data = []
        for backend in self.registry.backends.values():
            for label in dict.fromkeys(backend.labels):  # ordered, no repeats
                data.append({"id": label, "object": "model", "owned_by": "vlm-reward-proxy",
                             "root": backend.config.model, "backend": backend.name})
        return {"object": "list", "data": data}

    async def relay(self, raw_body: bytes) -> Relayed:
        try:
            request = json.loads(raw_body)
        except ValueError as err:
            raise InvalidRequest("body is not JSON", field="body") from err
        if not isinstance(request, dict) or not isinstance(request.get("model"), str):
            raise InvalidRequest("body must be a JSON object with a string 'model'", field="model")
        backend = self.registry.resolve(request["model"], field="model")
        backend.pool.check_admission()
        if request["model"] != backend.config.model:
            request["model"] = backend.config.model
            raw_body = json.dumps(request, separators=(",", ":")).encode()
        if request.get("stream"):
            return await self._relay_stream(backend, raw_body)
        return await self._relay_whole(backend, raw_body)

    async def _relay_whole(self, backend: Backend, body: bytes) -> Relayed:
        cfg = backend.config

        async def send(attempt: Attempt) -> httpx.Response:
            return await backend.call(attempt.avoid, self.metrics, lambda endpoint: self.upstream.forward(
                endpoint, body, timeout_s=attempt.timeout_s, api_key=cfg.api_key()))

        response, _, calls = await call_with_retries(cfg.retry, send, lambda r: r)
        self.metrics.requests.labels(route="chat", backend=backend.name, outcome=str(response.status_code)).inc()
        return Relayed(response.status_code, response.content, None,
                       response.headers.get("content-type", "application/json"), calls)

    async def _relay_stream(self, backend: Backend, body: bytes) -> Relayed:
        """Hold the endpoint slot until the last byte; retry only while nothing was sent."""
        cfg, pool = backend.config, backend.pool

        async def send(attempt: Attempt):
            reservation = await pool.reserve(attempt.avoid)
            endpoint = reservation.endpoint
            try:
                response = await self.upstream.forward(endpoint, body, timeout_s=attempt.timeout_s,
                                                       api_key=cfg.api_key(), stream=True)
            except UpstreamError as err:
                backend.note_failure(endpoint, err, self.metrics)
                pool.release(reservation, ok=False)
                raise
            except BaseException:
                pool.release(reservation, ok=False)
                raise
            return reservation, response

        (reservation, response), _, calls = await call_with_retries(cfg.retry, send, lambda r: r)
        self.metrics.requests.labels(route="chat_stream", backend=backend.name,
                                     outcome=str(response.status_code)).inc()
        if response.status_code != 200:  # forward() already read and closed it
            pool.release(reservation, ok=True)
            return Relayed(response.status_code, response.content, None,
                           response.headers.get("content-type", "application/json"), calls)

        async def chunks() -> AsyncIterator[bytes]:
            finished = False
            try:
                async for chunk in response.aiter_raw():
                    yield chunk
                finished = True
            finally:
                await response.aclose()
                pool.release(reservation, ok=finished)

        return Relayed(200, None, chunks(), response.headers.get("content-type", "text/event-stream"), calls)
