"""Readiness of `vllm serve` endpoints: the one probe, used by the proxy and by `up`.

An endpoint is ready when `GET /health` answers 200 and `GET /v1/models` (with the backend's
API key: `vllm serve --api-key` guards /v1) lists the served model name. `probe` never raises.

`Prober` runs it for every endpoint of every backend in the background: results feed each
endpoint's circuit (a failed probe counts like a failed request) and are cached, so `GET
/health` answers from the cache without calling upstream. The loop logs and survives anything.
Each round probes the pools' endpoints as they are then (endpoints come and go at run time:
proxy/http/admin_routes.py); the results of endpoints no longer in a pool are dropped.

What `GET /health` shows of an endpoint (`endpoint_health`): /health answers without a key, so
anyone who may not score sees states and codes (`reason_code`, and a `reason` in the proxy's own
words); the detailed reason (which may quote a server's answer or an error's text) only goes to a
caller who may score, i.e. holds a key or asks a proxy that needs none: the same caller already
sees that text in error answers. Credentials in URLs (`http://user:pass@host`) are never shown.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["Prober", "Readiness", "endpoint_health", "probe", "server_root", "without_credentials"]

log = logging.getLogger("vlm_reward_proxy.health")


# userinfo (everything up to the authority's last "@"), as URL parsers take it
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#]*@")


def without_credentials(text: str) -> str:
    return _USERINFO.sub(r"\1***@", text)


@dataclass(frozen=True)
class Readiness:
    ready: bool
    reason: str | None = None  # why not, in words (may quote the server: the log's and keyed callers')
    checked_at: float = 0.0  # time.time() of the probe
    code: str | None = None  # why not, as a code: connection_refused, health_status, models_unauthorized, ...
    summary: str | None = None  # why not, in the proxy's own words only (shown to anyone)


def server_root(base_url: str) -> str:
    """Where /health lives: vLLM serves it beside /v1, not under it."""
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url


async def probe(http: httpx.AsyncClient, base_url: str, model: str | None, *, timeout_s: float,
                headers: dict[str, str] | None = None) -> Readiness:
    """`model=None` asks only that the server answers /health at all (the proxy itself, whose
    /health is 503 while its backends load)."""
    now = time.time()

    def not_ready(code: str, summary: str, detail: str | None = None) -> Readiness:
        return Readiness(False, f"{summary}{detail}" if detail else summary, now, code, summary)

    try:
        health = await http.get(server_root(base_url) + "/health", timeout=timeout_s, headers=headers)
        if model is None:
            return Readiness(True, None, now)
        if health.status_code != 200:
            return not_ready("health_status", f"/health answered {health.status_code}")
        models = await http.get(base_url + "/models", timeout=timeout_s, headers=headers)
        if models.status_code == 401:
            return not_ready("models_unauthorized", "/v1/models answered 401: the backend's api_key_env does "
                             "not hold the server's --api-key")
        if models.status_code != 200:
            return not_ready("models_status", f"/v1/models answered {models.status_code}")
        listed = models.json().get("data")
        served = [m.get("id") for m in listed if isinstance(m, dict)] if isinstance(listed, list) else None
    except httpx.ConnectError:
        return not_ready("connection_refused", "connection refused (not started, or still loading)")
    except httpx.InvalidURL as err:  # an endpoint added at run time may be no URL httpx can call
        return not_ready("invalid_url", "not a URL that can be called", f": {err}")
    except httpx.HTTPError as err:
        return not_ready("transport_error", type(err).__name__, f": {err}" if str(err) else None)
    except (ValueError, AttributeError):
        return not_ready("bad_model_list", "/v1/models did not answer a JSON model list")
    if served is None:
        return not_ready("bad_model_list", "/v1/models did not answer a model list")
    if model not in served:
        return not_ready("model_not_served", f"model {model!r} not served", f" (serves {served})")
    return Readiness(True, None, now)


def open_probe_client(keepalive_s: float = 4.0) -> httpx.AsyncClient:
    """The prober's client: one small GET per endpoint per interval. httpx, as `probe` is shared
    with the synchronous launcher; idle connections expire before vLLM's 5 s keep-alive does."""
    return httpx.AsyncClient(limits=httpx.Limits(max_connections=64, keepalive_expiry=keepalive_s),
                             timeout=httpx.Timeout(30.0, connect=5.0), trust_env=False)


class Prober:
    """Probe every endpoint every `interval_s`; keep the latest result per endpoint."""

    def __init__(self, registry: Any, http: httpx.AsyncClient, *, interval_s: float, timeout_s: float) -> None:
        self.registry = registry  # proxy.upstream.backends.BackendRegistry
        self.http = http
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.results: dict[tuple[str, str], Readiness] = {}  # (backend, endpoint url) -> latest

    async def run_once(self) -> None:
        checks = [(backend, endpoint) for backend in self.registry.backends.values()
                  for endpoint in backend.pool.endpoints]
        outcomes = await asyncio.gather(*(
            probe(self.http, endpoint.base_url, backend.config.model, timeout_s=self.timeout_s,
                  headers=endpoint.auth_headers(backend.config.api_key()))
            for backend, endpoint in checks))
        for (backend, endpoint), readiness in zip(checks, outcomes, strict=True):
            if any(e is endpoint for e in backend.pool.endpoints):  # not removed during the round
                self.results[(backend.name, endpoint.base_url)] = readiness
                backend.pool.record_probe(endpoint, readiness.ready, readiness.reason)
        self.prune()

    def prune(self) -> None:
        """Drop the results of endpoints that left their pool (removed at run time, drained)."""
        present = {(b.name, e.base_url) for b in self.registry.backends.values() for e in b.pool.endpoints}
        for key in self.results.keys() - present:
            del self.results[key]

    def forget(self, backend: str, endpoint: str) -> None:
        """Drop one endpoint's result (one added anew is "not probed yet" until the next round)."""
        self.results.pop((backend, endpoint), None)

    async def run_until(self, stop: asyncio.Event) -> None:
        """Probe every `interval_s` until `stop` is set. Stopping waits for the round in flight
        (each probe is bounded by `timeout_s`) instead of cancelling it: a native cancel in the
        middle of httpcore closing a dead connection leaves that connection's socket open."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
                return
            except TimeoutError:
                pass
            try:
                await self.run_once()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("health probe round failed; probing again in %gs", self.interval_s)

    def readiness(self, backend: str, endpoint: str) -> Readiness:
        return self.results.get((backend, endpoint), Readiness(False, "not probed yet", 0.0, "not_probed",
                                                               "not probed yet"))


def endpoint_health(endpoint: Any, readiness: Readiness, *, detailed: bool) -> dict[str, Any]:
    """One endpoint (proxy.upstream.pool.Endpoint) in GET /health. The newest evidence wins: requests that
    failed since the last good probe or call, or a call it answered since a failed probe (a server
    restarted between two probes). `detailed`: the reason's full text (see the module's docstring)."""
    circuit = endpoint.state()
    failing = endpoint.consecutive_failures > 0
    answered = readiness.ready or endpoint.answered_at > readiness.checked_at
    if failing:
        in_a_row = f"({endpoint.consecutive_failures} in a row)"
        code, summary = ((readiness.code, f"health probe: {readiness.summary} {in_a_row}")
                         if endpoint.last_failure_by_probe else ("requests_failing", f"requests failing {in_a_row}"))
        reason = endpoint.last_failure if detailed else summary
    elif answered:
        code = reason = None
    else:
        code, reason = readiness.code, readiness.reason if detailed else readiness.summary
    return {"url": without_credentials(endpoint.base_url), "in_flight": endpoint.in_flight, "circuit": circuit,
            "draining": endpoint.draining, "checked_s_ago": round(max(0.0, time.time() - readiness.checked_at), 3),
            "ready": answered and circuit != "open" and not failing and not endpoint.draining,
            "reason_code": code, "reason": without_credentials(reason) if reason else None}
