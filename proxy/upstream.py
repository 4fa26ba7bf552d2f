"""The only module that talks to `vllm serve`, and the only place its failures are translated.

One shared httpx.AsyncClient per process (connection pool, keep-alive). Which endpoint to call
is pool.py's business; this module makes the call and turns every failure into a ProxyError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

from proxy.errors import (
    MediaKwargsRefused,
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.pool import Endpoint
from vlm_protocol.wire import parse_retry_after

_MM_KWARGS_PARAMS = ("media_io_kwargs", "mm_processor_kwargs")


@dataclass(frozen=True)
class Choice:
    text: str
    finish_reason: str | None
    # vLLM's `logprobs.content`: [{token, logprob, top_logprobs: [{token, logprob}]}], when asked
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ChatReply:
    """One chat completion: every choice (n samples), the first one's text and finish reason."""

    choices: tuple[Choice, ...]
    model: str | None
    usage: dict[str, Any] | None
    endpoint: str

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


def _error_info(response: httpx.Response) -> tuple[str, str | None]:
    """vLLM's error body is {"error": {"message", "type", "param", "code"}}."""
    try:
        error = response.json().get("error", {})
        if isinstance(error, dict):
            return str(error.get("message", ""))[:500], error.get("param")
        return str(error)[:500], None
    except (ValueError, AttributeError):
        return response.text[:500], None


def translate_status(response: httpx.Response, endpoint: str) -> Exception:
    status = response.status_code
    message, param = _error_info(response)
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    if status == 429 or status >= 500:
        return UpstreamUnavailable(f"{endpoint} answered {status}: {message}", endpoint=endpoint,
                                   upstream_status=status, retry_after_s=retry_after)
    if status == 400 and param in _MM_KWARGS_PARAMS:
        return MediaKwargsRefused(
            f"{endpoint} refuses per-request {param}: start `vllm serve` with "
            "--trust-request-mm-kwargs (the shipped launchers do), or set "
            "request_mm_kwargs: false for this backend (vLLM then keeps at most 32 frames "
            "and assumes fps 1)", endpoint=endpoint, upstream_status=status)
    return UpstreamRejected(f"{endpoint} rejected the request with {status}: {message}",
                            endpoint=endpoint, upstream_status=status)


POOL_SHARDS = 8
# Per shard. Idle connections expire at 4 s, before vLLM's uvicorn closes them at 5 s
# (TIMEOUT_KEEP_ALIVE): reusing one as the server closes it is a failed call for nothing.
POOL_LIMITS = httpx.Limits(max_connections=128, max_keepalive_connections=64, keepalive_expiry=4.0)


def open_http_clients(shards: int = POOL_SHARDS) -> list[httpx.AsyncClient]:
    """The process's connection pools. Several shards, not one: httpx scans every connection of
    a pool on each request start and finish, which cost 40% of the event loop with ~256
    connections in one pool (bench/profile_proxy.py); per-call timeouts come from the backend."""
    return [httpx.AsyncClient(limits=POOL_LIMITS, timeout=httpx.Timeout(120.0, connect=5.0),
                              trust_env=False)  # upstreams are addressed directly, never via env proxies
            for _ in range(shards)]


class UpstreamClient:
    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        self.clients = clients
        self._turn = 0

    @property
    def http(self) -> httpx.AsyncClient:
        """The next pool shard, round-robin."""
        self._turn = (self._turn + 1) % len(self.clients)
        return self.clients[self._turn]

    async def _post(self, endpoint: Endpoint, path: str, body: bytes, timeout_s: float,
                    api_key: str | None, stream: bool = False) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        http = self.http
        request = http.build_request("POST", endpoint.base_url + path, content=body, headers=headers,
                                     timeout=timeout_s)
        try:
            return await http.send(request, stream=stream)
        except httpx.TimeoutException as err:
            raise UpstreamTimeout(f"{endpoint.base_url} did not answer within {timeout_s:.1f}s",
                                  endpoint=endpoint.base_url) from err
        except httpx.DecodingError as err:  # e.g. a Content-Encoding its body does not match
            raise UpstreamProtocolError(f"{endpoint.base_url} sent an undecodable body: {err}",
                                        endpoint=endpoint.base_url) from err
        except httpx.RequestError as err:  # connect/read/write errors, protocol errors, ...
            raise UpstreamUnavailable(f"{endpoint.base_url}: {type(err).__name__}: {err}",
                                      endpoint=endpoint.base_url) from err

    async def chat(self, endpoint: Endpoint, body: bytes, *, timeout_s: float,
                   api_key: str | None = None) -> ChatReply:
        """POST /chat/completions once and read the reply. Raises only proxy errors."""
        response = await self._post(endpoint, "/chat/completions", body, timeout_s, api_key)
        if response.status_code != 200:
            raise translate_status(response, endpoint.base_url)
        return _read_completion(response, endpoint.base_url)

    async def forward(self, endpoint: Endpoint, body: bytes, *, timeout_s: float,
                      api_key: str | None = None, stream: bool = False) -> httpx.Response:
        """Pass-through for /v1/chat/completions: a 2xx or a non-retryable 4xx comes back as is
        (streamed when asked; the caller closes it); a retryable failure raises for the policy."""
        response = await self._post(endpoint, "/chat/completions", body, timeout_s, api_key, stream)
        status = response.status_code
        if stream and status != 200:
            try:
                await response.aread()
            except httpx.HTTPError as err:  # the error reply broke off: its status still tells
                error = UpstreamUnavailable if status == 429 or status >= 500 else UpstreamProtocolError
                raise error(f"{endpoint.base_url} answered {status} with a body that broke off",
                            endpoint=endpoint.base_url, upstream_status=status) from err
            finally:
                await response.aclose()
        if status == 429 or status >= 500:
            raise translate_status(response, endpoint.base_url)
        return response


def _read_choice(choice: dict) -> Choice:
    text, finish_reason = choice["message"]["content"], choice.get("finish_reason")
    if not all(v is None or isinstance(v, str) for v in (text, finish_reason)):
        raise TypeError("content and finish_reason must be strings")
    logprobs = (choice.get("logprobs") or {}).get("content")
    if logprobs is not None and not (isinstance(logprobs, list) and all(
            isinstance(e, dict) and isinstance(e.get("token"), str)
            and isinstance(e.get("top_logprobs") or [], list) for e in logprobs)):
        raise TypeError("logprobs.content must be a list of {token, logprob, top_logprobs}")
    return Choice(text or "", finish_reason, logprobs)


def _read_completion(response: httpx.Response, endpoint: str) -> ChatReply:
    try:
        payload = json.loads(response.content)
        # in index order: vLLM lists n choices by index, but the index is what names a sample
        choices = tuple(_read_choice(c) for c in sorted(payload["choices"], key=lambda c: c.get("index", 0)))
        if not choices:
            raise IndexError("no choices")
        if not (payload.get("model") is None or isinstance(payload.get("model"), str)):
            raise TypeError("model must be a string")
        usage = payload.get("usage")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise UpstreamProtocolError(f"{endpoint} answered 200 with a body that is not a chat "
                                    f"completion ({type(err).__name__}: {err})", endpoint=endpoint) from err
    return ChatReply(choices=choices, model=payload.get("model"),
                     usage=usage if isinstance(usage, dict) else None, endpoint=endpoint)
