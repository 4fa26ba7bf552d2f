"""The client against an in-process fake proxy (httpx.MockTransport): retries, failure policy,
typed errors, batching. The real proxy is exercised in test_integration.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import numpy as np
import pytest

from rlinf_client import (
    APIConnectionError,
    APIResponseValidationError,
    APITimeoutError,
    AsyncRewardClient,
    BadGatewayError,
    Episode,
    EpisodeFrameBuffer,
    NotFoundError,
    RateLimitError,
    RewardClient,
    RewardConfigError,
    RewardModelConfig,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from rlinf_client._base_client import retry_delay
from rlinf_client._exceptions import (
    APIStatusError,
    FramesError,
    InternalServerError,
    make_status_error,
)
from tests.client._support import FakeProxy, error_response, frame_tag, read_body, score_body, tagged_frames
from tests.helpers import HANG_S, wait_until
from vlm_protocol.wire import BUDGET_HEADER, MAX_RETRY_AFTER_S, parse_retry_after

FRAMES = tagged_frames(0, range(40), size=8)
# Stops a call that hangs from blocking the suite; never a measure of how fast a call returns.
HANG_GUARD_S = 60


def client_for(fake: FakeProxy, **overrides) -> AsyncRewardClient:
    overrides.setdefault("batch", "never")
    return AsyncRewardClient(endpoint="http://proxy.test/score", http_transport=fake.transport(),
                             **overrides)


async def test_a_score_and_what_was_sent():
    fake = FakeProxy(score_fn=lambda body, frames: 0.75)
    async with client_for(fake, backend="PRIMO-R1", backend_kwargs={"score_mode": "auto"}) as client:
        result = await client.score_episode(FRAMES, "open the drawer", fallback=0.0)
    assert (result.ok, result.value, result.score, result.reason, result.attempts) == (True, 0.75, 0.75, None, 1)
    [body] = fake.score_requests
    assert body["task_text"] == "open the drawer" and body["backend"] == "PRIMO-R1"
    assert body["backend_kwargs"] == {"score_mode": "auto"} and body["max_pixels"] == 200704
    # 16 of the 40 steps picked here: their real rate at LIBERO's 20 Hz, and the seed's video_fps
    assert (body["nframes"], body["fps"], body["video_fps"]) == (16, 20.0 * 16 / 40, 4.0)
    assert "video_path" not in body and "frames" not in body


async def test_without_client_sampling_all_frames_go_and_the_clip_rate_is_kept():
    fake = FakeProxy()
    async with client_for(fake, client_sampling=False) as client:
        await client.score_episode(FRAMES, "t")
    [body] = fake.score_requests
    # all 40 steps go, at their real rate; the proxy picks 16 and presents them at video_fps
    assert (body["nframes"], body["fps"], body["video_fps"]) == (16, 20.0, 4.0)


async def test_a_retryable_503_is_retried_after_its_retry_after():
    # every replica out of rotation: the proxy called no vLLM and says so
    fake = FakeProxy(script=[error_response(503, "upstream_unavailable", retry_after="0.2", retryable=True)],
                     score_fn=lambda body, frames: 0.6)
    async with client_for(fake) as client:
        started = time.monotonic()
        result = await client.score_episode(FRAMES, "t")
    assert result.ok and result.attempts == 2 and time.monotonic() - started >= 0.2
    assert client.stats.retries == 1


async def test_what_the_proxy_already_retried_is_not_retried_again():
    # the proxy spent its own retry budget on vLLM: retrying here would multiply the calls
    fake = FakeProxy(script=[error_response(503, "upstream_unavailable", retryable=False)])
    async with client_for(fake) as client:
        result = await client.score_episode(FRAMES, "t")
    assert (result.ok, result.reason, result.attempts) == (False, "upstream_unavailable", 1)
    assert len(fake.requests) == 1 and client.stats.retries == 0


async def test_only_connections_that_never_opened_are_retried():
    fake = FakeProxy(script=[httpx.ConnectError("refused")])
    async with client_for(fake) as client:
        result = await client.score_episode(FRAMES, "t")
    assert result.ok and result.attempts == 2
    fake = FakeProxy(script=[httpx.RemoteProtocolError("closed mid-answer")])  # it may have been scored
    async with client_for(fake) as client:
        result = await client.score_episode(FRAMES, "t")
    assert (result.ok, result.reason, result.attempts) == (False, "connection_error", 1)


async def test_429_whose_retry_after_outlasts_the_timeout_fails_at_once():
    # Waiting out the Retry-After (300 s) cannot end in a score within the call's 120 s: the 429 is
    # final at once. A client that waited instead (for the Retry-After, or until its deadline) would
    # still be waiting when the hang guard ends the call, and that is a TimeoutError, not this.
    fake = FakeProxy(script=[error_response(429, "overloaded", retry_after="300")])
    async with client_for(fake, timeout=120.0, fail_on_request_error=True) as client:
        with pytest.raises(RateLimitError) as caught:
            await asyncio.wait_for(client.score_episode(FRAMES, "t"), HANG_GUARD_S)
    assert caught.value.code == "overloaded" and caught.value.retry_after == 300
    assert caught.value.attempts == 1 and len(fake.requests) == 1 and client.stats.retries == 0


@pytest.mark.parametrize(("response", "error_type", "code"), [
    (error_response(422, "media_decode_error", field="frames_npy"), UnprocessableEntityError, "media_decode_error"),
    (error_response(404, "unknown_backend"), NotFoundError, "unknown_backend"),
    (error_response(502, "unparseable_score"), BadGatewayError, "unparseable_score"),
    (httpx.Response(200, json={"backend": "x"}), APIResponseValidationError, "bad_response"),
    (httpx.Response(200, json={"score": 7.5}), APIResponseValidationError, "bad_response"),
    (httpx.Response(200, text="<html>"), APIResponseValidationError, "bad_response"),
])
async def test_failures_raise_typed_errors_with_the_proxys_code(response, error_type, code):
    fake = FakeProxy(script=[response])
    async with client_for(fake, fail_on_request_error=True) as client:
        with pytest.raises(error_type) as caught:
            await client.score_episode(FRAMES, "t", fallback=1.0)
    assert caught.value.code == code and caught.value.attempts == 1  # not retried
    assert len(fake.requests) == 1 and client.stats.failures == 1


async def test_the_fallback_env_success_uses_the_simulators_flag_marked_and_counted():
    fake = FakeProxy(script=[error_response(502, "unparseable_score"),
                             error_response(422, "invalid_request")])
    async with client_for(fake, fallback="env_success") as client:
        first = await client.score_episode(FRAMES, "t", fallback=1.0)
        second = await client.score_episode(FRAMES, "t")  # no flag given: None, never a guess
        third = await client.score_episode(FRAMES, "t", fallback=0.0)
    assert (first.ok, first.value, first.score, first.reason) == (False, 1.0, None, "unparseable_score")
    assert isinstance(first.error, BadGatewayError) and first.fallback
    assert (second.ok, second.value, second.reason) == (False, None, "invalid_request")
    assert third.ok and third.value == 0.5
    assert client.stats.failures == 2 and client.stats.scored == 1
    assert dict(client.stats.failure_reasons) == {"unparseable_score": 1, "invalid_request": 1}


@pytest.mark.parametrize(("settings", "policy"), [
    ({}, "zero"), ({"fail_on_request_error": False}, "zero"), ({"fail_on_request_error": True}, "raise"),
    ({"fallback": "zero"}, "zero"), ({"fallback": "env_success"}, "env_success"), ({"fallback": "raise"}, "raise")])
async def test_the_failure_policy_is_an_explicit_choice_never_the_simulator_by_default(settings, policy):
    fake = FakeProxy(script=[error_response(502, "unparseable_score")])
    async with client_for(fake, **settings) as client:
        assert client.config.failure_policy == policy
        if policy == "raise":
            with pytest.raises(BadGatewayError):
                await client.score_episode(FRAMES, "t", fallback=1.0)
            return
        result = await client.score_episode(FRAMES, "t", fallback=1.0)  # the simulator said success
    assert (result.ok, result.value) == (False, {"zero": 0.0, "env_success": 1.0}[policy])
    assert client.stats.failures == 1


def test_a_contradictory_failure_policy_is_refused():
    with pytest.raises(RewardConfigError, match="fail_on_request_error: true means fallback: raise"):
        RewardModelConfig(fail_on_request_error=True, fallback="env_success")
    with pytest.raises(RewardConfigError, match="fallback must be one of"):
        RewardModelConfig(fallback="simulator")


Answer = Callable[[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Event], Awaitable[None]]


@contextlib.asynccontextmanager
async def loopback_proxy(answer: Answer, **overrides) -> AsyncIterator[AsyncRewardClient]:
    """A real socket: an asyncio server on loopback that runs `answer(reader, writer, released)`
    for each connection, and a client of it. `released` is set only on the way out, so a server
    that waits for it never finishes its answer while the test runs; then every handler is awaited
    and the server closed."""
    released, handlers = asyncio.Event(), []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handlers.append(asyncio.current_task())
        try:
            await answer(reader, writer, released)
        except ConnectionError:
            pass  # the client hung up (it gave up on the answer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        # These servers speak /score only: raw frames, so no GET /frame-rules reaches them.
        async with AsyncRewardClient(endpoint=f"http://127.0.0.1:{port}/score", batch="never",
                                     **{"frame_encoding": "raw", **overrides}) as client:
            yield client
    finally:
        released.set()
        await asyncio.gather(*handlers, return_exceptions=True)
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One HTTP request (head and body) off the socket."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return head + await reader.readexactly(length)


async def test_the_timeout_bounds_a_proxy_that_never_answers():
    """The server reads the request and answers nothing until the test is over: only the timeout
    can end the call."""
    requests = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     released: asyncio.Event) -> None:
        requests.append(await _read_request(reader))
        await released.wait()

    async with loopback_proxy(silent, timeout=0.4) as client:
        started = time.monotonic()
        result = await asyncio.wait_for(client.score_episode(FRAMES, "t", fallback=0.0), HANG_GUARD_S)
        elapsed = time.monotonic() - started
    assert (result.ok, result.value, result.reason) == (False, 0.0, "timeout")
    # the request's own timeout ended it (one attempt; the call's backstop would report none)
    assert isinstance(result.error, APITimeoutError) and result.attempts == 1
    assert len(requests) == 1 and requests[0].startswith(b"POST /score ")
    assert elapsed >= 0.4 - 1e-3  # a timeout cannot fire before it is due


async def test_retries_stop_at_max_retries():
    fake = FakeProxy(script=[httpx.ConnectError("refused")] * 10)
    async with client_for(fake, max_retries=2, fail_on_request_error=True) as client:
        with pytest.raises(APIConnectionError) as caught:
            await client.score_episode(FRAMES, "t")
    assert caught.value.attempts == 3 and not isinstance(caught.value, APITimeoutError)


async def test_score_episodes_keeps_order_and_sends_each_envs_frames():
    fake = FakeProxy(score_fn=lambda body, frames: frame_tag(frames[-1])[0] / 100)
    episodes = [Episode(tagged_frames(env, range(20 + env), size=8), f"task {env}", 0.0) for env in range(12)]
    async with client_for(fake) as client:
        results = await client.score_episodes(episodes)
    assert [r.value for r in results] == [env / 100 for env in range(12)]
    assert sorted(b["task_text"] for b in fake.score_requests) == sorted(f"task {e}" for e in range(12))


async def test_fail_on_request_error_in_a_burst_raises_the_typed_error():
    fake = FakeProxy(script=[error_response(422, "media_decode_error")])
    async with client_for(fake, fail_on_request_error=True, max_concurrency=1) as client:
        with pytest.raises(UnprocessableEntityError):
            await client.score_episodes([(FRAMES, "t", 0.0)] * 5)


async def test_batch_is_used_when_offered_and_its_item_errors_handled():
    fake = FakeProxy(batch=True, score_fn=lambda body, frames: frame_tag(frames[0])[0] / 10)
    episodes = [Episode(tagged_frames(env, range(10), size=8), "t", 0.0) for env in range(5)]
    async with client_for(fake, batch="auto") as client:
        results = await client.score_episodes(episodes)
        assert [r.value for r in results] == [0.0, 0.1, 0.2, 0.3, 0.4]
        batch_bodies = [b for path, b in fake.requests if path == "/score/batch"]
        assert len(batch_bodies) == 2 and batch_bodies[0] == {"items": []}  # probe, then one batch
        # An item the proxy could not take (and says so) is sent again, alone through /score.
        item_error = {"index": 0, "ok": False, "status": 429,
                      "error": {"code": "overloaded", "message": "busy", "retryable": True}}
        fine = {"index": 1, "ok": True, "status": 200,
                "result": {"score": 0.9, "backend": "fake"}}
        fake.script.append(httpx.Response(200, json={"results": [item_error, fine]}))
        results = await client.score_episodes(episodes[:2])
        assert [r.value for r in results] == [0.0, 0.9] and all(r.ok for r in results)
        assert fake.requests[-1][0] == "/score"


@pytest.mark.parametrize("mangle", [
    lambda results: results[::-1],  # out of order, each still naming its own item
    lambda results: [{k: v for k, v in r.items() if k != "index"} for r in results],  # no index at all
], ids=["reversed", "no_index"])
async def test_batch_results_not_at_their_index_are_never_paid_by_position(mangle):
    # Each env's score is its first frame's tag: a permuted answer would pay env 0 env 4's reward.
    fake = FakeProxy(batch=True, score_fn=lambda body, frames: frame_tag(frames[0])[0] / 10)
    episodes = [Episode(tagged_frames(env, range(10), size=8), "t", 0.0) for env in range(5)]
    async with client_for(fake, batch="auto") as client:
        await client.score_episodes(episodes[:2])  # the probe and a first, well-formed batch
        answer = [{"index": i, "ok": True, "status": 200, "result": score_body(i / 10)} for i in range(5)]
        fake.script.append(httpx.Response(200, json={"results": mangle(answer)}))
        results = await client.score_episodes(episodes)
        assert [r.value for r in results] == [0.0, 0.1, 0.2, 0.3, 0.4] and all(r.ok for r in results)
        assert client.uses_batch is False  # such a proxy's batches are not trusted again
    assert [path for path, _ in fake.requests][-5:] == ["/score"] * 5  # each episode scored on its own


async def test_a_refused_batch_falls_back_to_score_and_bad_frames_fail_alone():
    fake = FakeProxy(batch=True, score_fn=lambda body, frames: 0.4)
    fake.script = [None, error_response(422, "invalid_request", "items.0: bad")]  # probe ok, batch refused
    bad = Episode(np.zeros((0, 8, 8, 3), dtype=np.uint8), "empty", 1.0)
    async with client_for(fake, batch="auto") as client:
        results = await client.score_episodes([(FRAMES, "a", 0.0), bad, (FRAMES, "b", 0.0)])
        assert [(r.ok, r.value, r.reason) for r in results] == [
            (True, 0.4, None), (False, 0.0, "invalid_frames"), (True, 0.4, None)]  # fallback: zero
        assert client.uses_batch is False
    assert [path for path, _ in fake.requests] == ["/score/batch", "/score/batch", "/score", "/score"]


async def test_no_batch_route_means_concurrent_score_calls_and_one_probe():
    fake = FakeProxy(batch=False)
    async with client_for(fake, batch="auto") as client:
        for _ in range(3):
            results = await client.score_episodes([(FRAMES, "t", 0.0)] * 4)
            assert all(r.ok for r in results)
    paths = [path for path, _ in fake.requests]
    assert paths.count("/score/batch") == 1 and paths.count("/score") == 12


def test_sync_client_works_inside_a_running_event_loop():
    """RLinf steps its envs from inside the EnvWorker's event loop; the blocking client must
    not need (or disturb) the caller's loop."""
    fake = FakeProxy(score_fn=lambda body, frames: 0.25)

    async def env_worker_loop() -> list[float]:
        with RewardClient(endpoint="http://proxy.test/score", batch="never",
                          http_transport=fake.transport()) as client:
            return [r.value for r in client.score_episodes([(FRAMES, "t", 0.0)] * 3)]

    assert asyncio.run(env_worker_loop()) == [0.25] * 3


def test_sync_client_close_is_idempotent_and_final():
    client = RewardClient(endpoint="http://proxy.test", http_transport=FakeProxy().transport())
    client.close()
    client.close()
    with pytest.raises(RuntimeError, match="closed"):
        client.score_episode(FRAMES, "t")


@pytest.mark.parametrize(("status", "cls"), [
    (400, "BadRequestError"), (403, "ForbiddenError"), (404, "NotFoundError"),
    (413, "PayloadTooLargeError"), (422, "UnprocessableEntityError"), (429, "RateLimitError"),
    (500, "InternalServerError"), (502, "BadGatewayError"), (503, "ServiceUnavailableError"),
    (504, "GatewayTimeoutError"), (507, "InternalServerError"), (418, "APIStatusError"),
])
def test_one_function_maps_status_to_class(status, cls):
    error = make_status_error(status, {"error": {"code": "c", "message": "m", "field": "f"}})
    assert type(error).__name__ == cls and isinstance(error, APIStatusError)
    assert (error.status_code, error.code, error.message, error.field) == (status, "c", "m", "f")


def test_status_errors_without_the_proxys_shape():
    error = make_status_error(503, "<html>bad gateway</html>")
    assert isinstance(error, ServiceUnavailableError) and isinstance(error, InternalServerError)
    assert error.code == "http_503"
    assert make_status_error(404, {"detail": "Not Found"}).message == "Not Found"


def test_retry_after_and_backoff():
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None, "250") == 0.25
    assert parse_retry_after("soon") is None
    assert 9 < parse_retry_after(
        time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 11))) <= 11
    assert parse_retry_after("1e999") == MAX_RETRY_AFTER_S  # capped, the same rule as the proxy's
    assert retry_delay(1, 2.0) == 2.0
    assert 0.375 <= retry_delay(1, None) <= 0.5 and 6 <= retry_delay(10, None) <= 8


@pytest.mark.parametrize("payload", [{"frames_npy": "QUJD"},
                                     {"task_text": 'say "hi"\n', "nframes": 4, "frames_npy": "QUJD"},
                                     {"task_text": "t", "video_path": "/tmp/x.mp4"}])
def test_request_bodies_are_valid_json(payload):
    from rlinf_client._base_client import ScoreRequestBody

    assert json.loads(ScoreRequestBody(payload).to_bytes()) == payload


def test_episode_inputs_can_be_tuples_or_dicts():
    fake = FakeProxy(score_fn=lambda body, frames: 0.5)
    with RewardClient(endpoint="http://proxy.test", batch="never", http_transport=fake.transport()) as client:
        results = client.score_episodes([(FRAMES, "a"), {"frames": FRAMES, "task_text": "b", "fallback": 1.0},
                                         Episode(np.asarray(FRAMES), "c")])
    assert [r.value for r in results] == [0.5, 0.5, 0.5]


# -- one deadline per episode, whatever path it takes -------------------------------------------
class _BatchThenHang(httpx.AsyncBaseTransport):
    """Offers batching (refuses the empty probe as a batching proxy does), answers the first batch
    with `batch_answer` after `latency_s`, and holds every later request until `released` is set
    (after the call): a retry, or the /score fallback, can end only by the call's deadline.
    `sent` holds (path, budget header in ms) of every request but the probe."""

    def __init__(self, batch_answer, latency_s: float) -> None:
        self.batch_answer, self.latency_s = batch_answer, latency_s
        self.sent: list[tuple[str, int]] = []
        self.released = asyncio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        if request.method == "GET":  # GET /frame-rules: a proxy older than the route
            return httpx.Response(404, json={"detail": "Not Found"})
        body = read_body(request)
        if request.url.path == "/score/batch" and not body["items"]:
            return error_response(422, "invalid_request")  # the probe: batching is offered
        self.sent.append((request.url.path, int(request.headers[BUDGET_HEADER])))
        if len(self.sent) == 1:
            await asyncio.sleep(self.latency_s)  # the proxy takes a while over the batch
            return self.batch_answer(len(body["items"]))
        await self.released.wait()
        return httpx.Response(200, json={"score": 0.9})


def _items_overloaded(n: int) -> httpx.Response:
    return httpx.Response(200, json={"results": [
        {"index": i, "ok": False, "status": 429, "error": {"code": "overloaded", "retryable": True}}
        for i in range(n)]})


@pytest.mark.parametrize("batch_answer", [
    _items_overloaded, lambda n: error_response(413, "payload_too_large")])
async def test_a_batch_and_its_retries_end_within_the_calls_timeout(batch_answer):
    proxy = _BatchThenHang(batch_answer, latency_s=0.3)
    try:
        async with AsyncRewardClient(endpoint="http://proxy.test/score", http_transport=proxy,
                                     timeout=1.5, batch="auto") as client:
            results = await asyncio.wait_for(
                client.score_episodes([(FRAMES, "a", 0.0), (FRAMES, "b", 0.0)]), HANG_GUARD_S)
    finally:
        proxy.released.set()
    # explicitly failed, each by the call's own schedule (attempts counted; an episode the call's
    # backstop had to fail would report none): the retry (or the /score fallback) never answers
    assert all((r.ok, r.value) == (False, 0.0) and r.attempts >= 1 for r in results), results
    assert {r.reason for r in results} <= {"overloaded", "timeout"}
    # one deadline: what followed the batch was given what the batch left of the call's budget,
    # not a timeout of its own (the batch took at least latency_s)
    (path, batch_budget), *later = proxy.sent
    assert path == "/score/batch" and batch_budget <= 1500
    assert all(budget <= batch_budget - 300 + 1 for _, budget in later), proxy.sent


async def test_the_timeout_bounds_a_reply_that_drips_in():
    """The reply's head comes at once, then its body a byte every 0.05 s, and it never ends (until
    the test is over): every read is answered well within the timeout, so only the bound on the
    whole request can end the call."""
    dripped = []

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                   released: asyncio.Event) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b'content-length: 1000000\r\n\r\n{"score": 0.9}')
        while not released.is_set():
            writer.write(b" ")
            await writer.drain()  # raises once the client has hung up
            dripped.append(1)
            await asyncio.sleep(0.05)

    async with loopback_proxy(drip, timeout=0.8) as client:
        result = await asyncio.wait_for(client.score_episode(FRAMES, "t", fallback=0.0), HANG_GUARD_S)
    assert (result.ok, result.value, result.reason) == (False, 0.0, "timeout")
    # the request's own bound ended it (one attempt; the call's backstop would report none)
    assert isinstance(result.error, APITimeoutError) and result.attempts == 1
    assert dripped  # the body had started to arrive


# -- transport: path temp files -------------------------------------------------------------------
async def test_an_unwritable_temp_video_dir_follows_the_failure_policy(tmp_path):
    pytest.importorskip("cv2")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    fake = FakeProxy()
    async with client_for(fake, transport="path", temp_video_dir=str(not_a_dir), fallback="env_success") as client:
        result = await client.score_episode(FRAMES, "t", fallback=1.0)
        assert (result.ok, result.value, result.reason) == (False, 1.0, "invalid_frames")
        assert isinstance(result.error, FramesError) and "cannot write temp MP4" in str(result.error)
    async with client_for(fake, transport="path", temp_video_dir=str(not_a_dir),
                          fail_on_request_error=True) as client:
        with pytest.raises(FramesError, match="cannot write temp MP4"):
            await client.score_episode(FRAMES, "t")
    assert fake.requests == []


@pytest.mark.parametrize("batch", ["never", "auto"])
async def test_cancel_while_the_body_is_built_still_deletes_the_temp_mp4(tmp_path, monkeypatch,
                                                                        batch):
    pytest.importorskip("cv2")
    import threading

    from rlinf_client import _base_client

    entered, release, built = threading.Event(), threading.Event(), []
    real = _base_client.build_request_body

    def slow_build(episode, cfg, *rest):
        entered.set()
        body = real(episode, cfg, *rest)
        built.append(body.temp_video)
        release.wait(HANG_S)  # the test sets it once the call is cancelled; the bound only stops a hang
        return body

    monkeypatch.setattr(_base_client, "build_request_body", slow_build)
    fake = FakeProxy(batch=True)
    async with client_for(fake, transport="path", temp_video_dir=str(tmp_path),
                          batch=batch) as client:
        task = asyncio.ensure_future(client.score_episodes([(FRAMES, "t", 0.0)]))
        assert await asyncio.to_thread(entered.wait, HANG_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        # the thread finishes, then its temp MP4 goes (polled off the loop, which may do the deleting)
        await asyncio.to_thread(wait_until, lambda: built and not list(tmp_path.iterdir()), HANG_S,
                                "the temp MP4 deleted")
    assert len(built) == 1 and built[0] is not None and list(tmp_path.iterdir()) == []
    assert fake.score_requests == []


@pytest.mark.parametrize("batch", ["never", "auto"])
async def test_a_proxy_without_the_binary_body_gets_the_frames_inline_from_then_on(batch, caplog):
    """An older proxy answers a multipart body 422 on `body`: the client says so once and sends
    the same episodes inline (base64 JSON), never turning the refusal into fallback rewards."""
    fake = FakeProxy(score_fn=lambda body, frames: 0.6, batch=True)
    refused = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.headers.get("content-type", "").startswith("multipart/"):
            refused.append(request.url.path)
            return error_response(422, "invalid_request", "the request body is not a JSON object", field="body")
        return fake.handle(request)

    client = AsyncRewardClient(endpoint="http://proxy.test/score", http_transport=httpx.MockTransport(handle),
                               batch=batch)
    async with client:
        results = await client.score_episodes([(FRAMES, "open the drawer"), (FRAMES, "close it")] * 2)
        again = await client.score_episode(FRAMES, "open the drawer")
    assert all(r.ok and r.value == 0.6 for r in [*results, again])
    assert 1 <= len(refused) <= 4  # the ones already on their way; then inline for the client's life
    assert sum("sending frames inline" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize(("stride", "short"), [
    (1, None),  # every step held: the 16 frames asked for go
    (8, {"wanted": 16, "sent": 6, "source_count": 40, "stride": 8, "why": "stride"}),  # steps 0, 8, 16, 24, 32 and the last
])
async def test_a_stride_that_leaves_out_frames_says_so(stride, short, caplog):
    """Issue 39, item 5: a frame_stride larger than the episode allows sends fewer frames than
    nframes; the proxy sees only what was sent, so the result, the client's stats and the log say it."""
    buffer = EpisodeFrameBuffer(capacity=0, stride=stride)
    for frame in FRAMES:
        buffer.append(frame)
    fake = FakeProxy(score_fn=lambda body, frames: 0.5)
    async with client_for(fake, frame_stride=stride) as client:
        result = await client.score_episode(buffer, "t")
    [body] = fake.score_requests
    assert result.ok and body["nframes"] == (short["sent"] if short else 16)
    assert result.frames_short == short
    assert client.stats.as_dict()["frames_short"] == (1 if short else 0)
    assert ("kept every 8-th of its 40 steps" in caplog.text) == (short is not None)
