"""The client schedules, it does not deadlock: any number of episodes against any max_concurrency
completes within the call's timeout, every episode scored or explicitly failed; a cancel or an
error releases everything it took. Against the real proxy and a fake vLLM on loopback."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import numpy as np
import pytest

from rlinf_client import AsyncRewardClient, AuthenticationError, Episode, RewardClient
from rlinf_client import _constants as C
from tests.fakes.episodes import episode_frames
from tests.helpers import HANG_S, wait_until
from vlm_protocol.wire import BUDGET_HEADER

QWEN = "qwen2_5_vl_vllm"
CONCURRENCY = 4
# A LIBERO-size episode buffer (64 frames of 256x256 RGB) and a small one.
BIG = episode_frames(64, 256, 256)
SMALL = episode_frames(6, 32, 32)
NEVER_S = 3600  # a fake vLLM told to wait this long answers nothing while the test runs
HANG_GUARD_S = 60  # stops a deadlocked call from blocking the suite; never a measure of speed


def cfg(proxy_server, **overrides) -> dict:
    return {"endpoint": f"{proxy_server.url}/score", "backend": QWEN, "timeout": 60,
            "max_concurrency": CONCURRENCY, **overrides}


async def _score_all(client: AsyncRewardClient, episodes: list[Episode]):
    # wait_for is the hang guard: a deadlock would fail here instead of stalling the suite
    return await asyncio.wait_for(client.score_episodes(episodes), client.config.timeout + HANG_GUARD_S)


class _BudgetLog(httpx.AsyncBaseTransport):
    """The real transport; notes, per request, the budget the client gave the proxy (ms, its
    BUDGET_HEADER) and how long the proxy held the request (s, until its answer's head)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.sent: list[tuple[int, float]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        started = time.monotonic()
        try:
            return await self.inner.handle_async_request(request)
        finally:
            if request.method == "POST":  # not GET /frame-rules, which carries no budget
                self.sent.append((int(request.headers[BUDGET_HEADER]), time.monotonic() - started))

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("batch", ["never", "auto"])
@pytest.mark.parametrize("times", [1, 2, 10])
@pytest.mark.parametrize("frames", [SMALL, BIG], ids=["small", "libero-size"])
async def test_more_episodes_than_slots_all_complete(proxy_server, fake_qwen, batch, times, frames):
    episodes = [Episode(frames, f"task {i}", 0.0) for i in range(times * CONCURRENCY)]
    async with AsyncRewardClient(cfg(proxy_server, batch=batch)) as client:
        results = await _score_all(client, episodes)
    assert [r.ok for r in results] == [True] * len(episodes), [r.reason for r in results if not r.ok]
    assert {r.value for r in results} == {0.75}
    assert fake_qwen.fake.state.chat_count == len(episodes)


async def test_more_episodes_than_bodies_in_memory_still_complete(proxy_server, fake_qwen):
    episodes = [Episode(SMALL, "t", 0.0) for _ in range(C.MAX_BODIES_IN_MEMORY + 30)]
    async with AsyncRewardClient(cfg(proxy_server, batch="auto")) as client:
        results = await _score_all(client, episodes)
    assert all(r.ok for r in results) and len(results) == len(episodes)


async def test_the_call_returns_within_its_timeout_with_every_episode_accounted_for(proxy_server, fake_qwen):
    # the model answers the first episode, then never again (while the test runs): only the call's
    # deadline can end it
    fake_qwen.script({}, *[{"hang_s": NEVER_S}] * 20)
    episodes = [Episode(SMALL, f"task {i}", 1.0) for i in range(3 * CONCURRENCY)]
    log = _BudgetLog()
    # 6 s: the first episode's answer must come within the call's time on a loaded machine; the
    # rest never answer, so the call's deadline alone ends them whatever its length.
    async with AsyncRewardClient(cfg(proxy_server, batch="never", timeout=6.0, max_concurrency=1),
                                 http_transport=log) as client:
        results = await _score_all(client, episodes)
    assert len(results) == len(episodes) and results[0].ok
    for result in results[1:]:  # the proxy's timeout (told the budget) or the client's: explicit either way
        assert not result.ok and result.reason in ("upstream_timeout", "timeout") and result.value == 0.0
    # One deadline for the call, not one per episode: the episodes go one at a time, and each is
    # given only what those before it left of the call's 6 s (int ms: +1 for the rounding).
    assert log.sent[0][0] <= 6000
    for (budget, held), (next_budget, _) in itertools.pairwise(log.sent):
        assert next_budget <= budget - held * 1e3 + 1, log.sent


@pytest.mark.parametrize("batch", ["never", "auto"])
async def test_cancel_mid_batch_releases_every_slot_and_body(proxy_server, fake_qwen, batch):
    fake_qwen.config.latency_base_s = 0.5
    async with AsyncRewardClient(cfg(proxy_server, batch=batch)) as client:
        task = asyncio.ensure_future(client.score_episodes([Episode(SMALL, "t", 0.0)] * (3 * CONCURRENCY)))
        await asyncio.to_thread(wait_until, lambda: fake_qwen.fake.state.chat_count >= 1, HANG_S,
                                "the first episode to reach vLLM")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        fake_qwen.config.latency_base_s = 0.0
        # Everything the cancelled call held is free again: a call needing every slot and
        # more bodies than a batch completes.
        results = await _score_all(client, [Episode(SMALL, "t", 0.0)] * (C.MAX_BODIES_IN_MEMORY + CONCURRENCY))
    assert all(r.ok for r in results)


async def test_an_error_while_building_a_body_releases_what_it_took(proxy_server, fake_qwen):
    broken = Episode(np.zeros((0, 8, 8, 3), dtype=np.uint8), "no frames", 1.0)
    episodes = [broken if i % 3 == 0 else Episode(SMALL, "t", 0.0) for i in range(C.MAX_BODIES_IN_MEMORY + 10)]
    async with AsyncRewardClient(cfg(proxy_server, batch="auto")) as client:
        results = await _score_all(client, episodes)
        again = await _score_all(client, [Episode(SMALL, "t", 0.0)] * C.MAX_BODIES_IN_MEMORY)
    assert [r.reason for r in results] == ["invalid_frames" if i % 3 == 0 else None for i in range(len(episodes))]
    assert all(r.ok for r in again)


def test_the_blocking_client_also_returns_within_its_timeout(proxy_server, fake_qwen):
    fake_qwen.config.latency_base_s = NEVER_S  # the model never answers while the test runs
    with RewardClient(cfg(proxy_server, timeout=1.0, batch="never")) as client:
        result = client.score_episode(SMALL, "t", fallback=0.0)
    # A result from the call's own schedule: one attempt, bounded by the timeout. Had the schedule
    # overrun, the blocking call would have been abandoned with an APITimeoutError instead.
    assert not result.ok and result.reason in ("upstream_timeout", "timeout") and result.attempts == 1
    assert fake_qwen.fake.state.chat_count == 1


async def test_the_proxy_is_told_the_budget_and_stops_before_the_client_gives_up(proxy_server, fake_qwen):
    fake_qwen.script(*[{"status": 503}] * 50)  # vLLM keeps failing: the proxy would retry for 30 s
    # 10 s: the proxy keeps back 1 s of the caller's budget to deliver its answer (retry.py's
    # BUDGET_MARGIN_S), a margin a loaded machine still meets; 2 s left it 0.2 s.
    async with AsyncRewardClient(cfg(proxy_server, timeout=10.0, batch="never")) as client:
        result = await client.score_episode(SMALL, "t", fallback=0.0)
    # the proxy's own answer (it gave up in time), not the client's timeout
    assert (result.ok, result.reason) == (False, "upstream_unavailable")
    assert result.attempts == 1  # what the proxy already retried is not sent again


def test_the_bearer_token_is_sent_and_a_wrong_one_is_a_typed_error(proxy_factory, fake_qwen, fake_primo,
                                                                   media_root, monkeypatch):
    from proxy.config import settings_from_dict
    from tests.conftest import libero_settings_dict

    monkeypatch.setenv("PROXY_TOKEN", "s3cret")
    server = proxy_factory(settings_from_dict(libero_settings_dict(
        [fake_qwen.base_url], [fake_primo.base_url], media_root, api_key_env="PROXY_TOKEN")))
    with RewardClient(cfg(server, api_key="s3cret")) as client:
        assert client.score_episode(SMALL, "t").ok
    monkeypatch.setenv(C.API_KEY_ENV, "s3cret")  # or from the environment
    with RewardClient(cfg(server)) as client:
        assert client.score_episode(SMALL, "t").ok
    with RewardClient(cfg(server, api_key="wrong", fail_on_request_error=True)) as client, \
            pytest.raises(AuthenticationError) as caught:
        client.score_episode(SMALL, "t")
    assert caught.value.status_code == 401 and caught.value.code == "unauthorized"
