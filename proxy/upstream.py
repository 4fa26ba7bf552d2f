"""The only module that talks to `vllm serve`, and the only place its failures are translated.

One shared httpx.AsyncClient per process (connection pool, keep-alive). Each backend has a pool
of endpoints; a request goes to the endpoint with the fewest requests in flight, skipping the
ones a retry wants to avoid.
"""

from __future__ import annotations

import email.utils
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.errors import (
    MediaKwargsRefused,
    UpstreamProtocolError,
    UpstreamRejected,
    UpstreamTimeout,
    UpstreamUnavailable,
)

_MM_KWARGS_PARAMS = ("media_io_kwargs", "mm_processor_kwargs")


@dataclass
class Endpoint:
    base_url: str  # ends in /v1
    in_flight: int = 0
    requests: int = 0
    failures: int = 0

    @property
    def server_root(self) -> str:
        """Where /health lives: vLLM serves it beside /v1, not under it."""
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url


@dataclass
class EndpointPool:
    endpoints: list[Endpoint]
    _next: int = field(default=0)

    @classmethod
    def from_urls(cls, urls: list[str]) -> EndpointPool:
        return cls([Endpoint(u) for u in urls])

    def pick(self, avoid: set[str] | None = None) -> Endpoint:
        """Least requests in flight; ties go round-robin. `avoid` is a wish, not a must."""
        candidates = [e for e in self.endpoints if not avoid or e.base_url not in avoid] or self.endpoints
        least = min(e.in_flight for e in candidates)
        tied = [e for e in candidates if e.in_flight == least]
        self._next += 1
        return tied[self._next % len(tied)]


@dataclass(frozen=True)
class ChatReply:
    text: str
    finish_reason: str | None
    model: str | None
    usage: dict[str, Any] | None
    endpoint: str


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


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


class UpstreamClient:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http

    async def chat(self, endpoint: Endpoint, body: bytes, *, timeout_s: float,
                   api_key: str | None = None) -> ChatReply:
        """POST /chat/completions once. Raises only proxy errors (see errors.py)."""
        url = endpoint.base_url + "/chat/completions"
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        endpoint.in_flight += 1
        endpoint.requests += 1
        try:
            response = await self.http.post(url, content=body, headers=headers, timeout=timeout_s)
        except httpx.TimeoutException as err:
            endpoint.failures += 1
            raise UpstreamTimeout(f"{endpoint.base_url} did not answer within {timeout_s:.1f}s",
                                  endpoint=endpoint.base_url) from err
        except httpx.TransportError as err:
            endpoint.failures += 1
            raise UpstreamUnavailable(f"{endpoint.base_url}: {type(err).__name__}: {err}",
                                      endpoint=endpoint.base_url) from err
        finally:
            endpoint.in_flight -= 1
        if response.status_code != 200:
            endpoint.failures += 1
            raise translate_status(response, endpoint.base_url)
        return _read_completion(response, endpoint.base_url)

    async def check(self, endpoint: Endpoint, model: str, timeout_s: float) -> dict[str, Any]:
        """Readiness as vLLM shows it: /health is 200 and /v1/models lists the model."""
        try:
            health = await self.http.get(endpoint.server_root + "/health", timeout=timeout_s)
            if health.status_code != 200:
                return {"ready": False, "reason": f"/health answered {health.status_code}"}
            models = await self.http.get(endpoint.base_url + "/models", timeout=timeout_s)
            served = [m.get("id") for m in models.json().get("data", [])]
        except httpx.HTTPError as err:
            return {"ready": False, "reason": f"{type(err).__name__}: {err}" if str(err) else type(err).__name__}
        except (ValueError, AttributeError):
            return {"ready": False, "reason": "/v1/models did not answer a model list"}
        if model not in served:
            return {"ready": False, "reason": f"model {model!r} not served (serves {served})"}
        return {"ready": True}


def _read_completion(response: httpx.Response, endpoint: str) -> ChatReply:
    try:
        payload = json.loads(response.content)
        choice = payload["choices"][0]
        text = choice["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError) as err:
        raise UpstreamProtocolError(f"{endpoint} answered 200 with a body that is not a chat "
                                    f"completion ({type(err).__name__})", endpoint=endpoint) from err
    return ChatReply(text=text or "", finish_reason=choice.get("finish_reason"),
                     model=payload.get("model"), usage=payload.get("usage"), endpoint=endpoint)
