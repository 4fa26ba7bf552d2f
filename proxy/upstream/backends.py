"""Configured backends by name or alias, each with its endpoint pool, and the one way to call them."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from proxy.config import BackendConfig, Settings
from proxy.errors import RETRYABLE_UPSTREAM, InvalidRequest, UnknownBackend, UpstreamError, UpstreamTimeout
from proxy.metrics import Metrics
from proxy.upstream.pool import Endpoint, EndpointPool
from proxy.upstream.retry import Attempt

T = TypeVar("T")
log = logging.getLogger("vlm_reward_proxy.upstream")


@dataclass
class Backend:
    name: str
    config: BackendConfig
    pool: EndpointPool

    @property
    def labels(self) -> list[str]:
        return [self.name, self.config.model, *self.config.aliases]

    async def call(self, attempt: Attempt, metrics: Metrics, fn: Callable[[Endpoint], Awaitable[T]],
                   group: str | None = None) -> T:
        """Run one upstream call on a reserved endpoint, feeding the outcome to its circuit.
        `group`: calls that share a prompt prefix (routing.policy affinity keeps them on one replica)."""
        queued = time.perf_counter()
        async with self.pool.acquire(attempt.avoid, group, until=attempt.until) as endpoint:
            attempt.slot_taken()
            metrics.queue_wait.labels(self.name).observe(time.perf_counter() - queued)
            try:
                result = await fn(endpoint)
            except UpstreamError as err:
                self.note_failure(endpoint, err, metrics, attempt)
                raise
            metrics.upstream_calls.labels(self.name, endpoint.base_url, "ok").inc()
            return result

    def note_failure(self, endpoint: Endpoint, err: UpstreamError, metrics: Metrics, attempt: Attempt) -> None:
        # 429 is back-pressure and a 4xx is our request's fault: neither means the replica is broken.
        # Nor does a timeout the caller's budget (or the request's deadline) cut short: a client
        # sending a short budget must not take a busy but healthy replica out of rotation. Only a
        # wait of the full timeout_s (or a connect timeout within it) is held against the replica.
        callers = isinstance(err, UpstreamTimeout) and attempt.deadline_bound and err.at_limit
        broken = isinstance(err, RETRYABLE_UPSTREAM) and err.upstream_status != 429 and not callers
        self.pool.record_failure(endpoint, cause=f"{err.code}: {err.message[:200]}", counts_for_circuit=broken)
        metrics.upstream_calls.labels(self.name, endpoint.base_url, err.code).inc()
        if isinstance(err, UpstreamTimeout):
            metrics.upstream_timeouts.labels(self.name, endpoint.base_url, "deadline" if callers else "timeout").inc()
        log.warning("upstream call failed: backend=%s endpoint=%s attempt=%d code=%s: %s",
                    self.name, endpoint.base_url, attempt.number, err.code, err.message[:300])


class BackendRegistry:
    """Backends by name, served model name and alias; the first configured one is the default."""

    def __init__(self, settings: Settings) -> None:
        self.backends = {
            name: Backend(name, cfg, EndpointPool(cfg.endpoints, cfg.admission, cfg.circuit, cfg.routing))
            for name, cfg in settings.backends.items()
        }
        self._by_label = {label: b for b in self.backends.values() for label in b.labels}

    def of_kind(self, kind: str) -> list[Backend]:
        return [b for b in self.backends.values() if b.config.kind == kind]

    def resolve(self, label: str | None, field: str = "backend", kind: str | None = "chat") -> Backend:
        """The backend `label` names (None: the first of `kind`); one of another kind is a 422
        that says which route serves it. kind None: any."""
        if label is None:
            fitting = self.of_kind(kind) if kind else list(self.backends.values())
            if not fitting:
                raise UnknownBackend(f"no {kind} backend is configured (kind: {kind})", field=field)
            return fitting[0]
        try:
            backend = self._by_label[label]
        except KeyError:
            known = sorted(self._by_label)
            raise UnknownBackend(f"unknown {field} {label!r}; known: {', '.join(known)}", field=field) from None
        if kind is not None and backend.config.kind != kind:
            route = "POST /progress/batch" if backend.config.kind == "embedding" else "/score and /compare"
            raise InvalidRequest(f"{field} {label!r} is a {backend.config.kind} backend, not {kind}: "
                                 f"it serves {route}", field=field)
        return backend
