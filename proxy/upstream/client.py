"""The only module that talks to `vllm serve`, and the only place its failures are translated.

One shared aiohttp session per process (connection pool, keep-alive) for the calls; the health
prober's GETs are health.py's (one httpx client, `open_probe_client`). Which endpoint to call
is pool.py's business; this module makes the call and turns every failure into a ProxyError.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import aiohttp
import aiohttp.http_exceptions

from proxy.answers.reply import ChatReply, Choice, EmbeddingReply
from proxy.errors import (
    MediaKwargsRefused,
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.upstream.pool import Endpoint
from vlm_protocol.wire import parse_retry_after

_MM_KWARGS_PARAMS = ("media_io_kwargs", "mm_processor_kwargs")


@dataclass(frozen=True)
class UpstreamAnswer:
    """A whole reply from vLLM, read and its connection released."""

    status_code: int
    headers: Mapping[str, str]
    content: bytes


class UpstreamStream:
    """A 200 reply whose body is relayed as it arrives; its owner must `aclose()` it."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.status_code, self.headers, self._response = response.status, response.headers, response

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.content.iter_any():
            yield chunk

    async def aclose(self) -> None:
        # A body read to its end leaves the connection reusable: back to the pool (aiohttp does
        # so at EOF already; release() says it). An unfinished one (the client left, an error)
        # would hand the next call the rest of this body: closed.
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()


def _error_info(answer: UpstreamAnswer) -> tuple[str, str | None]:
    """vLLM's error body is {"error": {"message", "type", "param", "code"}}."""
    try:
        error = json.loads(answer.content).get("error", {})
        if isinstance(error, dict):
            return str(error.get("message", ""))[:500], error.get("param")
        return str(error)[:500], None
    except (ValueError, AttributeError):
        return answer.content.decode("utf-8", "replace")[:500], None


def translate_status(answer: UpstreamAnswer, endpoint: str) -> Exception:
    status = answer.status_code
    message, param = _error_info(answer)
    retry_after = parse_retry_after(answer.headers.get("retry-after"))
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


# Idle connections expire at 4 s, before vLLM's uvicorn closes them at 5 s (TIMEOUT_KEEP_ALIVE):
# reusing one as the server closes it is a failed call for nothing.
KEEPALIVE_S = 4.0
MAX_CONNECTIONS = 1024  # admission (max_in_flight per endpoint) is the real bound
CONNECT_TIMEOUT_S = 5.0


def open_session() -> aiohttp.ClientSession:
    """The process's upstream connection pool (call inside the running loop). aiohttp, not httpx,
    for the calls that carry frames: the same 519 KB POST cost 1.9-2.1 ms of CPU through httpx
    against 0.5-0.8 ms through aiohttp (bench/bench_proxy_overhead.py, docs/benchmarks.md §1)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, limit_per_host=0, keepalive_timeout=KEEPALIVE_S),
        trust_env=False,  # upstreams are addressed directly, never via env proxies
        skip_auto_headers=("User-Agent",))


class UpstreamClient:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def _post(self, endpoint: Endpoint, path: str, body: bytes, timeout_s: float,
                    api_key: str | None, stream: bool = False, *, from_root: bool = False
                    ) -> UpstreamAnswer | UpstreamStream:
        """One POST. A whole reply is read within `timeout_s`; a 200 stream must have its
        headers within `timeout_s`, then may pause at most `timeout_s` between chunks.
        `from_root`: `path` is under the server's root, not its /v1 (vLLM's /tokenize)."""
        headers = {"content-type": "application/json", **endpoint.auth_headers(api_key)}
        url = (endpoint.base_url.removesuffix("/v1") if from_root else endpoint.base_url) + path
        response = handed_off = None
        try:
            async with asyncio.timeout(timeout_s):
                # sock_connect, not connect: a wait for a slot in our own pool is not the replica's.
                # No redirects: the body (frames) and the backend's key go to the endpoint itself
                # and nowhere else (admin_endpoint_hosts); a 3xx is a broken reply.
                response = await self.session.post(
                    url, data=body, headers=headers, allow_redirects=False,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(CONNECT_TIMEOUT_S, timeout_s),
                                                  sock_read=timeout_s))
                if 300 <= response.status < 400:
                    raise UpstreamProtocolError(f"{endpoint.base_url} answered {response.status} (a redirect): the "
                                                "proxy never follows one", endpoint=endpoint.base_url)
                if stream and response.status == 200:
                    handed_off = UpstreamStream(response)
                    return handed_off
                content = await response.read()
            return UpstreamAnswer(response.status, response.headers, content)
        except TimeoutError as err:  # asyncio's deadline, or aiohttp's connect / read timeouts
            timeout = UpstreamTimeout(f"{endpoint.base_url} did not answer within {timeout_s:.1f}s",
                                      endpoint=endpoint.base_url)
            # No connection within CONNECT_TIMEOUT_S, shorter than this call's limit: the replica's.
            timeout.at_limit = not (isinstance(err, aiohttp.ConnectionTimeoutError) and timeout_s > CONNECT_TIMEOUT_S)
            raise timeout from err
        except aiohttp.ClientPayloadError as err:
            if isinstance(err.__cause__, aiohttp.http_exceptions.ContentEncodingError):
                raise UpstreamProtocolError(f"{endpoint.base_url} sent an undecodable body: {err}",
                                            endpoint=endpoint.base_url) from err
            raise UpstreamUnavailable(f"{endpoint.base_url}: the reply broke off: {err}",
                                      endpoint=endpoint.base_url) from err
        except (aiohttp.ClientError, OSError) as err:  # connect, reset, protocol errors, ...
            raise UpstreamUnavailable(f"{endpoint.base_url}: {type(err).__name__}: {err}",
                                      endpoint=endpoint.base_url) from err
        finally:
            if response is not None and handed_off is None:
                # back to the pool when read whole; aiohttp closes a connection with unread body
                response.release() if response.content.is_eof() else response.close()

    async def chat(self, endpoint: Endpoint, body: bytes, *, timeout_s: float,
                   api_key: str | None = None) -> ChatReply:
        """POST /chat/completions once and read the reply. Raises only proxy errors."""
        answer = await self._post(endpoint, "/chat/completions", body, timeout_s, api_key)
        if answer.status_code != 200:
            raise translate_status(answer, endpoint.base_url)
        return _read_completion(answer, endpoint.base_url)

    async def embed(self, endpoint: Endpoint, body: bytes, *, timeout_s: float,
                    api_key: str | None = None) -> EmbeddingReply:
        """POST /embeddings once (one conversation: one vector). Raises only proxy errors."""
        answer = await self._post(endpoint, "/embeddings", body, timeout_s, api_key)
        if answer.status_code != 200:
            raise translate_status(answer, endpoint.base_url)
        return _read_embedding(answer, endpoint.base_url)

    async def tokenize(self, endpoint: Endpoint, model: str, text: str, *, timeout_s: float,
                       api_key: str | None = None) -> list[int]:
        """vLLM's POST /tokenize of `text` alone (no special tokens): the served model's token ids."""
        body = json.dumps({"model": model, "prompt": text, "add_special_tokens": False}).encode()
        answer = await self._post(endpoint, "/tokenize", body, timeout_s, api_key, from_root=True)
        if answer.status_code != 200:
            raise translate_status(answer, endpoint.base_url)
        try:
            tokens = json.loads(answer.content)["tokens"]
            if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
                raise TypeError("tokens must be a list of integers")
        except (ValueError, KeyError, TypeError) as err:
            raise UpstreamProtocolError(f"{endpoint.base_url}: /tokenize answered 200 with a body that is not a "
                                        f"tokenization ({type(err).__name__}: {err})",
                                        endpoint=endpoint.base_url) from err
        return tokens

    async def forward(self, endpoint: Endpoint, body: bytes, *, timeout_s: float,
                      api_key: str | None = None, stream: bool = False) -> UpstreamAnswer | UpstreamStream:
        """Pass-through for /v1/chat/completions: a 2xx or a non-retryable 4xx comes back as is
        (a 200 streamed when asked; the caller closes it); a retryable failure raises for the policy."""
        answer = await self._post(endpoint, "/chat/completions", body, timeout_s, api_key, stream)
        if isinstance(answer, UpstreamAnswer) and (answer.status_code == 429 or answer.status_code >= 500):
            raise translate_status(answer, endpoint.base_url)
        return answer


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


def _read_completion(answer: UpstreamAnswer, endpoint: str) -> ChatReply:
    try:
        payload = json.loads(answer.content)
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


def _read_embedding(answer: UpstreamAnswer, endpoint: str) -> EmbeddingReply:
    """An OpenAI embedding list with one finite, non-zero float vector: anything else is a broken
    reply (siiRL's trainer met all-zero V-JEPA vectors; here one is an error, never a distance)."""
    try:
        payload = json.loads(answer.content)
        data = payload["data"]
        if not isinstance(data, list) or len(data) != 1:
            raise ValueError(f"expected one embedding, got {len(data) if isinstance(data, list) else data!r}")
        vector = data[0]["embedding"]
        if not isinstance(vector, list) or not vector or not all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in vector):
            raise ValueError("embedding must be a non-empty list of finite numbers (encoding_format float)")
        if not any(vector):
            raise ValueError("embedding is all zeros")
        model, usage = payload.get("model"), payload.get("usage")
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as err:
        raise UpstreamProtocolError(f"{endpoint} answered 200 with a body that is not an embedding "
                                    f"({type(err).__name__}: {err})", endpoint=endpoint) from err
    return EmbeddingReply(vector=tuple(float(x) for x in vector), model=model if isinstance(model, str) else None,
                          usage=usage if isinstance(usage, dict) else None, endpoint=endpoint)
