"""The endpoint pool: balancing, caps, and a half-open circuit that lets exactly one trial in."""

import math
import time

import pytest

from proxy.config import AdmissionConfig, CircuitConfig
from proxy.errors import Overloaded, UpstreamUnavailable
from proxy.upstream.pool import EndpointPool


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


# -- affinity routing (routing.policy: affinity) -------------------------------------------------
def _routed_pool(n=2, **routing):
    from proxy.config import RoutingConfig

    return EndpointPool([f"http://127.0.0.1:{9000 + i}/v1" for i in range(n)], AdmissionConfig(),
                        CircuitConfig(failures=1, cooldown_s=60), RoutingConfig(**routing))


async def test_a_group_keeps_its_replica_while_it_is_within_the_load_bound():
    pool = _routed_pool(4)
    homes = {}
    for key in (f"frame:{i}" for i in range(64)):
        picks = set()
        for _ in range(5):  # one at a time: never over the bound
            reservation = await pool.reserve(key=key)
            picks.add(reservation.endpoint.base_url)
            pool.release(reservation, ok=True)
        assert len(picks) == 1
        homes[key] = picks.pop()
    # Rendezvous hashing spreads groups over every replica (64 keys, 4 replicas).
    assert len(set(homes.values())) == 4
    assert pool.routed == {"affinity": 320, "spilled": 0, "least_outstanding": 0}


async def test_a_busy_home_spills_to_the_next_and_the_load_stays_bounded():
    pool = _routed_pool(2, load_factor=1.25, group_slack=8)
    held = [await pool.reserve(key="group:7") for _ in range(40)]
    home = held[0].endpoint
    assert all(r.endpoint is home for r in held[:9])  # a group of 8 (and more) stays together at low load
    # never over the bound: ceil(1.25 x the average in flight) + the slack
    assert home.in_flight == math.ceil(1.25 * 40 / 2) + 8 == 33
    assert pool.routed == {"affinity": 33, "spilled": 7, "least_outstanding": 0}
    for reservation in held:
        pool.release(reservation, ok=True)


async def test_a_home_out_of_rotation_moves_only_its_groups():
    pool = _routed_pool(3)
    keys = [f"frame:{i}" for i in range(30)]

    async def homes() -> dict[str, str]:
        found = {}
        for key in keys:
            reservation = await pool.reserve(key=key)
            found[key] = reservation.endpoint.base_url
            pool.release(reservation, ok=True)
        return found

    before = await homes()
    down = pool.endpoints[0]
    pool.record_failure(down, cause="upstream_unavailable: 503")  # failures=1: out of rotation
    after = await homes()
    assert all(after[k] == before[k] for k in keys if before[k] != down.base_url)  # the rest stay put
    assert all(after[k] != down.base_url for k in keys)


async def test_without_a_group_or_with_the_policy_off_it_is_least_outstanding():
    for pool, key in ((_routed_pool(2), None), (_routed_pool(2, policy="least_outstanding"), "frame:1")):
        first, second = await pool.reserve(key=key), await pool.reserve(key=key)
        assert first.endpoint is not second.endpoint
        assert pool.routed == {"affinity": 0, "spilled": 0, "least_outstanding": 2}


# -- endpoints added and removed at run time (POST /admin/endpoints) ------------------------------
async def test_a_removed_endpoint_drains_then_leaves():
    pool = _pool(2)
    gone, kept = pool.endpoints
    held = [await pool.reserve(), await pool.reserve()]
    on_gone = next(r for r in held if r.endpoint is gone)
    assert pool.remove(gone.base_url) is True
    assert gone.draining and gone in pool.endpoints  # a call still in flight on it
    assert pool.remove(gone.base_url) is False  # already draining: nothing more to do
    for _ in range(5):  # no new call goes to it, whatever its load
        reservation = await pool.reserve()
        assert reservation.endpoint is kept
        pool.release(reservation, ok=True)
    pool.release(on_gone, ok=True)  # the call in flight ends normally
    assert pool.endpoints == [kept]
    pool.release(next(r for r in held if r.endpoint is kept), ok=True)


async def test_removing_an_idle_endpoint_is_at_once_and_an_unknown_one_is_a_key_error():
    pool = _pool(2)
    pool.remove(pool.endpoints[0].base_url)
    assert [e.base_url for e in pool.endpoints] == ["http://127.0.0.1:9001/v1"]
    with pytest.raises(KeyError):
        pool.remove("http://127.0.0.1:9999/v1")


async def test_a_draining_endpoint_gets_no_group_and_no_half_open_trial():
    pool = _routed_pool(2)  # failures=1
    key = "frame:1"
    home = (await pool.reserve(key=key)).endpoint
    other = next(e for e in pool.endpoints if e is not home)
    pool.remove(home.base_url)  # a call in flight: it drains
    reservation = await pool.reserve(key=key)
    assert reservation.endpoint is other  # the group moves, as when its replica leaves
    assert pool.routed["affinity"] == 2  # `other` is now the key's first live replica
    pool.release(reservation, ok=True)
    home.open_until = time.monotonic() - 1  # a circuit past its cool-down would let one trial in
    pool.record_failure(other, cause="upstream_unavailable: 503")  # the other one is out
    with pytest.raises(UpstreamUnavailable):
        await pool.reserve(key=key)  # the half-open draining one is no candidate


async def test_adding_back_a_draining_endpoint_cancels_the_drain():
    pool = _pool(1)
    endpoint = pool.endpoints[0]
    held = await pool.reserve()
    pool.remove(endpoint.base_url)
    assert pool.add(endpoint.base_url) is True  # reported as added: it is in rotation again
    assert not endpoint.draining
    assert pool.add(endpoint.base_url) is False  # already in rotation: nothing done
    pool.release(held, ok=True)
    assert pool.endpoints == [endpoint]  # the last call ending no longer removes it


async def test_the_last_endpoint_removed_fails_fast_and_an_added_one_serves():
    pool = _pool(1)
    pool.remove(pool.endpoints[0].base_url)
    assert pool.endpoints == []
    with pytest.raises(UpstreamUnavailable, match="no endpoints: all were removed at run time") as err:
        await pool.reserve()
    assert err.value.retryable and err.value.retry_after_s == 1.0
    assert pool.add("http://127.0.0.1:9100/v1") is True
    reservation = await pool.reserve()
    assert reservation.endpoint.base_url == "http://127.0.0.1:9100/v1"
    pool.release(reservation, ok=True)


async def _turns_until(condition, turns: int = 20) -> bool:
    """Let the loop run a few turns (no clock involved) until `condition()` holds."""
    import asyncio

    for _ in range(turns):
        if condition():
            return True
        await asyncio.sleep(0)
    return condition()


async def test_a_waiter_proceeds_when_an_endpoint_is_added():
    import asyncio

    pool = _pool(1, max_in_flight_per_endpoint=1)
    held = await pool.reserve()  # the only slot
    waiter = asyncio.ensure_future(pool.reserve())
    assert await _turns_until(lambda: pool.waiting == 1)  # queued
    pool.add("http://127.0.0.1:9100/v1")
    assert await _turns_until(waiter.done)  # woken by the add, not by its periodic look
    reservation = waiter.result()
    assert reservation.endpoint.base_url == "http://127.0.0.1:9100/v1"
    pool.release(reservation, ok=True)
    pool.release(held, ok=True)


async def test_a_waiter_fails_at_once_when_the_last_endpoint_is_removed():
    import asyncio

    pool = _pool(1, max_in_flight_per_endpoint=1)
    held = await pool.reserve()
    waiter = asyncio.ensure_future(pool.reserve())
    assert await _turns_until(lambda: pool.waiting == 1)
    pool.remove(pool.endpoints[0].base_url)  # draining: the queue has nowhere to go
    assert await _turns_until(waiter.done)  # at once, not after its periodic look
    with pytest.raises(UpstreamUnavailable, match="no endpoints"):
        waiter.result()
    pool.release(held, ok=True)
    assert pool.endpoints == []
