"""A backend's replicas: balancing, per-endpoint caps, circuit breakers, and the admission queue.

- `acquire` hands out a usable endpoint below its in-flight cap, preferring ones this request has
  not failed on yet: with a group key under `routing.policy: affinity`, the first in the key's
  rendezvous order whose calls in flight stay within `load_factor` x the average + `group_slack`,
  so a group's calls share a replica's prefix cache without piling onto it; else (or when every
  endpoint is over that bound) the one with the fewest calls in flight, ties round-robin. When all are at
  their cap the caller waits in a bounded queue; a full queue is `Overloaded` (429) at once.
- An endpoint's circuit opens after `failures` consecutive failures — transport/5xx failures of
  requests and failed health probes alike: it gets no traffic until `cooldown_s` passes (then
  one trial request) or a probe finds it ready. Success closes it. 429 is back-pressure, not
  breakage: it does not count; nor does a timeout the caller's budget or the request's deadline
  cut short of `timeout_s` (proxy.upstream.backends.Backend.note_failure): a client with a short budget
  cannot take a busy, healthy replica out of rotation. The endpoint remembers why it opened (`last_failure`).
- No usable endpoint at all (every circuit open) fails fast with UpstreamUnavailable, marked
  retryable (no upstream call was made) with a Retry-After of the earliest cool-down's end.
- Endpoints come and go at run time (`add`, `remove`: POST /admin/endpoints). Removing drains:
  the endpoint takes no new call (nor a half-open trial, nor a group's), the calls in flight on
  it end normally, and it leaves `endpoints` when the last one does. Adding wakes the queue. A
  backend with no endpoint left answers UpstreamUnavailable (retryable) at once, never a hang.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

from proxy.config import AdmissionConfig, CircuitConfig, RoutingConfig, split_credentials
from proxy.errors import Overloaded, UpstreamTimeout, UpstreamUnavailable


@dataclass
class Endpoint:
    base_url: str  # ends in /v1; never with credentials (split_credentials)
    credentials: tuple[str, str] | None = field(default=None, repr=False, compare=False)  # HTTP basic auth
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    open_until: float = 0.0  # monotonic; 0 = circuit closed
    trial_in_flight: bool = False
    last_failure: str | None = None  # why the last request or probe failed, for messages
    last_failure_by_probe: bool = False  # (then /health can name the probe's code to anyone)
    draining: bool = False  # removed at run time: no new calls; gone from the pool when the last ends
    answered_at: float = 0.0  # time.time() of its last good call or probe: newer than a failed probe, it wins

    def auth_headers(self, api_key: str | None) -> dict[str, str]:
        """The Authorization header of a call: the backend's vLLM key (Bearer), else the URL's
        user:password (Basic, UTF-8 as httpx sends it); config refuses both on one backend."""
        if api_key:
            return {"authorization": f"Bearer {api_key}"}
        if self.credentials:
            pair = ":".join(self.credentials).encode()
            return {"authorization": "Basic " + base64.b64encode(pair).decode("ascii")}
        return {}

    @property
    def circuit_open(self) -> bool:
        return self.open_until > 0

    def state(self) -> str:
        if not self.circuit_open:
            return "closed"
        return "half_open" if time.monotonic() >= self.open_until else "open"

    def rotation(self) -> str:
        """ready (in rotation), open (circuit open or half-open) or draining (/metrics' states)."""
        if self.draining:
            return "draining"
        return "open" if self.circuit_open else "ready"


class Reservation(NamedTuple):
    endpoint: Endpoint
    trial: bool  # the one request let through a half-open circuit


class EndpointPool:
    def __init__(self, urls: list[str], admission: AdmissionConfig | None = None,
                 circuit: CircuitConfig | None = None, routing: RoutingConfig | None = None) -> None:
        self.endpoints = [Endpoint(*split_credentials(u)) for u in urls]
        self.admission = admission or AdmissionConfig()
        self.circuit = circuit or CircuitConfig()
        self.routing = routing or RoutingConfig()
        self.routed: dict[str, int] = {"affinity": 0, "spilled": 0, "least_outstanding": 0}  # decisions, /metrics
        self.waiting = 0
        self._turn = 0
        self._waiters: deque[asyncio.Future] = deque()

    # -- choosing -----------------------------------------------------------------------------
    def _usable(self, endpoint: Endpoint, now: float) -> bool:
        if endpoint.draining or endpoint.in_flight >= self.admission.max_in_flight_per_endpoint:
            return False
        if not endpoint.circuit_open:
            return True
        return now >= endpoint.open_until and not endpoint.trial_in_flight  # half-open: one trial

    def _any_alive(self, now: float) -> bool:
        return any(not e.draining and (not e.circuit_open or now >= e.open_until) for e in self.endpoints)

    def _choose(self, avoid: set[str], key: str | None = None) -> Reservation | None:
        now = time.monotonic()
        usable = [e for e in self.endpoints if self._usable(e, now)]
        preferred = [e for e in usable if e.base_url not in avoid] or usable
        if not preferred:
            return None
        chosen = self._by_affinity(preferred, key) if key is not None and self.routing.policy == "affinity" else None
        if chosen is None:
            least = min(e.in_flight for e in preferred)
            tied = [e for e in preferred if e.in_flight == least]
            self._turn += 1
            chosen = tied[self._turn % len(tied)]
            self.routed["spilled" if key is not None and self.routing.policy == "affinity"
                        else "least_outstanding"] += 1
        trial = chosen.circuit_open  # half-open: this reservation is the one trial
        if trial:
            chosen.trial_in_flight = True
        chosen.in_flight += 1
        chosen.requests += 1
        return Reservation(chosen, trial)

    def _by_affinity(self, candidates: list[Endpoint], key: str) -> Endpoint | None:
        """The key's first endpoint in rendezvous order within the load bound, or None (all over it).
        Rendezvous (highest random weight) hashing moves only the keys of an endpoint that leaves.
        The bound: load_factor x the candidates' average calls in flight (this one included), plus
        `group_slack` — at low load a whole group stays together rather than spreading at once."""
        total = sum(e.in_flight for e in candidates) + 1
        bound = math.ceil(self.routing.load_factor * total / len(candidates)) + self.routing.group_slack
        ranked = sorted((e for e in self.endpoints if not e.draining), reverse=True,  # the key's own replica
                        key=lambda e: hashlib.blake2b(f"{key}|{e.base_url}".encode(), digest_size=8).digest())
        for endpoint in ranked:
            if endpoint in candidates and endpoint.in_flight + 1 <= bound:
                self.routed["affinity" if endpoint is ranked[0] else "spilled"] += 1
                return endpoint
        return None

    def has_room(self, reserve_slots: int) -> bool:
        """Nobody is queued and more than `reserve_slots` slots are free on ready endpoints: work that
        must never delay real requests (an invariance probe) may start."""
        if self.waiting:
            return False
        cap = self.admission.max_in_flight_per_endpoint
        return sum(max(0, cap - e.in_flight) for e in self.endpoints if e.rotation() == "ready") > reserve_slots

    def check_admission(self) -> None:
        """Refuse early (before any media work) when the queue is already full."""
        if self.waiting >= self.admission.max_queue:
            raise Overloaded(f"{self.waiting} requests already wait for this backend "
                             f"(admission.max_queue {self.admission.max_queue})", retry_after_s=1.0)

    @asynccontextmanager
    async def acquire(self, avoid: set[str] | None = None, key: str | None = None,
                      until: float | None = None) -> AsyncIterator[Endpoint]:
        """Reserve an in-flight slot on one endpoint for the duration of the block (`key`: a group;
        `until`: see reserve)."""
        reservation = await self.reserve(avoid, key, until)
        ok = False
        try:
            yield reservation.endpoint
            ok = True
        finally:
            self.release(reservation, ok)

    async def reserve(self, avoid: set[str] | None = None, key: str | None = None,
                      until: float | None = None) -> Reservation:
        """Take a slot; the caller must `release` it (streams hold it until the last byte).
        `until` (time.monotonic()): the request's deadline; waiting for a slot past it is an
        UpstreamTimeout, so a queue never holds a request longer than its caller will wait."""
        avoid = avoid or set()
        reservation = self._choose(avoid, key)
        if reservation is None:
            self.check_admission()
            self.waiting += 1
            try:
                reservation = await self._wait_for_slot(avoid, key, until)
            finally:
                self.waiting -= 1
        return reservation

    async def _wait_for_slot(self, avoid: set[str], key: str | None, until: float | None) -> Reservation:
        """FIFO: each release wakes exactly one waiter (no thundering herd at 1000 waiting)."""
        loop = asyncio.get_running_loop()
        front = False
        while True:
            now = time.monotonic()
            if not self._any_alive(now):
                raise self._all_down()
            if until is not None and now >= until:
                raise UpstreamTimeout(
                    f"no in-flight slot of this backend came free before the request's deadline ("
                    f"{self.waiting} requests wait; admission.max_in_flight_per_endpoint "
                    f"{self.admission.max_in_flight_per_endpoint})")
            woken = loop.create_future()
            (self._waiters.appendleft if front else self._waiters.append)(woken)
            try:
                # Wake on a release, or now and then to notice a cool-down ending (or the deadline).
                await asyncio.wait({woken}, timeout=0.5 if until is None else min(0.5, until - now))
            except BaseException:
                if woken.done() and not woken.cancelled():
                    self._notify()  # cancelled after being woken: pass the freed slot on
                raise
            finally:
                if not woken.done():
                    self._waiters.remove(woken)
                    woken.cancel()
            reservation = self._choose(avoid, key)
            if reservation is not None:
                return reservation
            front = woken.done() and not woken.cancelled()  # woken but beaten to it: keep its place

    def _all_down(self) -> UpstreamUnavailable:
        now, live = time.monotonic(), [e for e in self.endpoints if not e.draining]
        if not live:
            return UpstreamUnavailable("this backend has no endpoints: all were removed at run time "
                                       "(POST /admin/endpoints adds one)", retryable=True, retry_after_s=1.0)
        reopens = max(0.0, min(e.open_until for e in live) - now)
        causes = "; ".join(f"{e.base_url}: {e.last_failure or 'unknown'}" for e in live)
        return UpstreamUnavailable(
            f"every endpoint of this backend is out of rotation ({causes}); the first may be tried "
            f"again in {reopens:.1f}s", retryable=True, retry_after_s=max(1.0, reopens))

    def release(self, reservation: Reservation, ok: bool) -> None:
        endpoint = reservation.endpoint
        endpoint.in_flight -= 1
        if reservation.trial:  # only the trial's own end may let the next trial in
            endpoint.trial_in_flight = False
        if ok:
            self.record_success(endpoint)
        if endpoint.draining and endpoint.in_flight == 0:
            self.endpoints.remove(endpoint)  # drained: the last call on it ended
        self._notify()

    def _notify(self, everyone: bool = False) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                if not everyone:
                    return

    # -- endpoints added and removed at run time ----------------------------------------------
    def find(self, url: str) -> Endpoint | None:
        name = split_credentials(url)[0]
        return next((e for e in self.endpoints if e.base_url == name), None)

    def add(self, url: str) -> bool:
        """Put `url` in rotation: a new endpoint, or a draining one (its drain is cancelled; its
        circuit and calls in flight are kept). False: it already is in rotation (nothing done)."""
        endpoint = self.find(url)
        if endpoint is not None:  # the same server: the credentials now written for it are the ones sent
            endpoint.credentials = split_credentials(url)[1] or endpoint.credentials
        if endpoint is not None and not endpoint.draining:
            return False
        if endpoint is None:
            self.endpoints.append(Endpoint(*split_credentials(url)))
        else:
            endpoint.draining = False
        self._notify(everyone=True)  # the queue may proceed on it
        return True

    def remove(self, url: str) -> bool:
        """Take `url` out of rotation: no new calls; it leaves `endpoints` when its calls in flight
        have ended (at once when there are none). False: it already drains. KeyError: not an endpoint."""
        endpoint = self.find(url)
        if endpoint is None:
            raise KeyError(url)
        if endpoint.draining:
            return False
        endpoint.draining = True
        if endpoint.in_flight == 0:
            self.endpoints.remove(endpoint)
        self._notify(everyone=True)  # waiters look again: with no endpoint left they fail at once
        return True

    # -- outcomes ------------------------------------------------------------------------------
    def record_success(self, endpoint: Endpoint) -> None:
        endpoint.answered_at = time.time()
        endpoint.consecutive_failures = 0
        endpoint.open_until = 0.0

    def record_failure(self, endpoint: Endpoint, *, cause: str, counts_for_circuit: bool = True) -> None:
        endpoint.failures += 1
        if not counts_for_circuit:
            return
        self._count_towards_circuit(endpoint, cause)

    def record_probe(self, endpoint: Endpoint, ready: bool, reason: str | None) -> None:
        """A readiness probe: ready closes the circuit; a failed one counts like a failed request
        (an endpoint that merely hiccups once stays in rotation)."""
        if ready:
            reopened = endpoint.circuit_open
            self.record_success(endpoint)
            if reopened:
                self._notify()
        else:
            self._count_towards_circuit(endpoint, f"health probe: {reason}")
            endpoint.last_failure_by_probe = True

    def _count_towards_circuit(self, endpoint: Endpoint, cause: str) -> None:
        endpoint.consecutive_failures += 1
        endpoint.last_failure_by_probe = False
        endpoint.last_failure = f"{cause} ({endpoint.consecutive_failures} in a row)"
        if endpoint.circuit_open or endpoint.consecutive_failures >= self.circuit.failures:
            endpoint.open_until = time.monotonic() + self.circuit.cooldown_s
