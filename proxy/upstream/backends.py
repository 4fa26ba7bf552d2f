"""Configured backends by name or alias, each with its endpoint pool, and the one way to call them."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from proxy.config import BackendConfig, Settings, split_credentials
from proxy.errors import RETRYABLE_UPSTREAM, InvalidRequest, UnknownBackend, UpstreamError, UpstreamTimeout
from proxy.metrics import Metrics
from proxy.upstream.pool import Endpoint, EndpointPool, Reservation
from proxy.upstream.retry import Attempt, call_with_retries

T = TypeVar("T")
P = TypeVar("P")
T_co = TypeVar("T_co", covariant=True)
log = logging.getLogger("vlm_reward_proxy.upstream")


class Send(Protocol[T_co]):
    """An UpstreamClient call: one request to one endpoint."""

    def __call__(self, endpoint: Endpoint, body: bytes, *, timeout_s: float, api_key: str | None) -> Awaitable[T_co]:
        ...


Held = tuple[Reservation, T]  # a reply whose endpoint slot its caller releases

# The bytes of a call's body, or how to make them on the endpoint an attempt reserved.
Body = bytes | Callable[[Endpoint, Attempt], Awaitable[bytes]]


class Asked(NamedTuple, Generic[T, P]):
    """What one ask came back with: the last reply, what `parse` read from it, the calls it took."""

    reply: T
    parsed: P
    calls: int


def _as_is(reply: T) -> T:
    return reply


def _ok(_reply: object) -> str:
    return "ok"


@dataclass
class Backend:
    name: str
    config: BackendConfig
    pool: EndpointPool

    @property
    def labels(self) -> list[str]:
        return [self.name, self.config.model, *self.config.aliases]

    async def ask(self, metrics: Metrics, send: Send[T], body: Body, parse: Callable[[T], P] = _as_is, *,
                  budget_s: float | None, on_reply: Callable[[T], None] | None = None, group: str | None = None,
                  outcome: Callable[[T], str] = _ok) -> Asked[T, P]:
        """Every call to a replica goes through here: the retry policy (proxy/upstream/retry.py)
        around one `send` (an UpstreamClient method) of `body` on a reserved endpoint slot, each
        outcome fed to that endpoint's circuit. `body` is the bytes, or made per attempt on its
        endpoint (a re-ask samples anew; a probability answer needs that endpoint's token ids, and
        the time its lookup takes comes off the attempt's timeout). `group` names calls that share
        a prompt prefix (routing.policy affinity keeps them on one replica); `outcome` labels a call
        that returned (a relayed 4xx counts as what it is)."""
        attempt_call = self._attempts(metrics, send, body, group, outcome, hold_slot=False)
        return Asked(*await call_with_retries(self.config.retry, attempt_call, parse, budget_s=budget_s,
                                              on_reply=on_reply))

    async def ask_holding_slot(self, metrics: Metrics, send: Send[T], body: bytes, *, budget_s: float | None,
                               outcome: Callable[[T], str] = _ok) -> Asked[Held[T], Held[T]]:
        """`ask` for a reply that outlives the call (a relayed stream): the slot stays reserved and
        the caller releases it with `pool.release` once the reply's last byte is gone."""
        attempt_call = self._attempts(metrics, send, body, None, outcome, hold_slot=True)
        return Asked(*await call_with_retries(self.config.retry, attempt_call, _as_is, budget_s=budget_s))

    def _attempts(self, metrics: Metrics, send: Send[T], body: Body, group: str | None,
                  outcome: Callable[[T], str], *, hold_slot: bool) -> Callable[[Attempt], Awaitable[Any]]:
        """One attempt: a slot, the body, the call, its outcome on the endpoint's circuit."""

        async def attempt_call(attempt: Attempt) -> Any:
            queued = time.perf_counter()
            reservation = await self.pool.reserve(attempt.avoid, group, until=attempt.until)
            endpoint = reservation.endpoint
            try:
                attempt.slot_taken()  # the deadline may have run out as the slot came free: nothing is sent
                metrics.queue_wait.labels(self.name).observe(time.perf_counter() - queued)
                payload = body if isinstance(body, bytes) else await body(endpoint, attempt)
                reply = await send(endpoint, payload, timeout_s=attempt.timeout_s, api_key=self.config.api_key())
            except UpstreamError as err:
                if attempt.sent:
                    self.note_failure(endpoint, err, metrics, attempt)
                self.pool.release(reservation, ok=False)
                raise
            except BaseException:
                self.pool.release(reservation, ok=False)
                raise
            metrics.upstream_calls.labels(self.name, endpoint.base_url, outcome(reply)).inc()
            if hold_slot:
                return reservation, reply
            self.pool.release(reservation, ok=True)
            return reply

        return attempt_call

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
        # Backends that name the same replicas share one pool (config checks they name the same
        # endpoints and configure the pool alike): one replica's calls in flight, circuit and queue
        # are counted once, whichever backend (a cascade's stage, another prompt) calls it.
        pools: dict[tuple[str, ...], EndpointPool] = {}
        self.backends = {}
        for name, cfg in settings.backends.items():
            replicas = tuple(split_credentials(url)[0] for url in cfg.endpoints)
            pool = pools.get(replicas) or pools.setdefault(
                replicas, EndpointPool(cfg.endpoints, cfg.admission, cfg.circuit, cfg.routing))
            self.backends[name] = Backend(name, cfg, pool)
        self._by_label = {label: b for b in self.backends.values() for label in b.labels}
        self.cascades = dict(settings.cascades)
        self._cascade_by_label = {label: name for name, c in self.cascades.items() for label in (name, *c.aliases)}

    def cascade(self, label: str | None) -> str | None:
        """The name of the cascade `label` names, if it names one."""
        return self._cascade_by_label.get(label) if label is not None else None

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
        if label in self._cascade_by_label:
            raise InvalidRequest(f"{field} {label!r} is a cascade: it serves /score and /score/batch, where its stages "
                                 "are asked in turn; this route takes one of its stages' backends", field=field)
        try:
            backend = self._by_label[label]
        except KeyError:
            known = sorted([*self._by_label, *self._cascade_by_label])
            raise UnknownBackend(f"unknown {field} {label!r}; known: {', '.join(known)}", field=field) from None
        if kind is not None and backend.config.kind != kind:
            route = "POST /progress/batch" if backend.config.kind == "embedding" else "/score and /compare"
            raise InvalidRequest(f"{field} {label!r} is a {backend.config.kind} backend, not {kind}: "
                                 f"it serves {route}", field=field)
        return backend
