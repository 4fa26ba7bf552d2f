"""The endpoint pool: balancing, caps, and a half-open circuit that lets exactly one trial in."""

import time

import pytest

from proxy.config import AdmissionConfig, CircuitConfig
from proxy.errors import Overloaded, UpstreamUnavailable
from proxy.pool import EndpointPool


def _pool(n=2, **admission):
    return EndpointPool([f"http://127.0.0.1:{9000 + i}/v1" for i in range(n)],
                        AdmissionConfig(**admission), CircuitConfig(failures=2, cooldown_s=60))


async def test_least_outstanding_then_round_robin():
    pool = _pool(2)
    first, second = await pool.reserve(), await pool.reserve()
    assert first.endpoint is not second.endpoint
    pool.release(first, ok=True)
    third = await pool.reserve()
    assert third.endpoint is first.endpoint  # the idle one


async def test_full_queue_is_overloaded():
    pool = _pool(1, max_in_flight_per_endpoint=1, max_queue=1)
    await pool.reserve()
    pool.waiting = 1  # one already queued
    with pytest.raises(Overloaded):
        await pool.reserve()


async def test_half_open_lets_exactly_one_trial_in():
    pool = _pool(1)
    endpoint = pool.endpoints[0]
    old = await pool.reserve()  # in flight since before the circuit opened
    pool.record_failure(endpoint, cause="upstream_unavailable: 503")
    pool.record_failure(endpoint, cause="upstream_unavailable: 503")
    assert endpoint.state() == "open"
    with pytest.raises(UpstreamUnavailable, match="503 \\(2 in a row\\)") as err:
        await pool.reserve()  # open and cooling down: nothing alive
    assert err.value.retryable  # nothing was sent: the caller may ask again
    endpoint.open_until = time.monotonic() - 1  # cool-down over: half-open
    trial = await pool.reserve()
    assert trial.trial
    pool.release(old, ok=False)  # an older request ending must not let a second trial in
    assert pool._choose(set()) is None
    pool.release(trial, ok=True)  # the trial succeeds: circuit closed
    assert endpoint.state() == "closed"


def test_probe_failures_count_towards_the_circuit_like_request_failures():
    pool = _pool(1)  # circuit.failures = 2
    endpoint = pool.endpoints[0]
    pool.record_probe(endpoint, False, "/health answered 503")
    assert endpoint.state() == "closed"  # one hiccup does not take it out of rotation
    pool.record_probe(endpoint, False, "/health answered 503")
    assert endpoint.state() == "open" and "health probe: /health answered 503" in endpoint.last_failure
    pool.record_probe(endpoint, True, None)
    assert endpoint.state() == "closed" and endpoint.consecutive_failures == 0
