"""The client against an in-process fake proxy (httpx.MockTransport): retries, failure policy,
typed errors, batching. The real proxy is exercised in test_integration.py."""

from __future__ import annotations

import asyncio
import json
import time

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
from tests.rlinf._support import FakeProxy, error_response, frame_tag, tagged_frames
from vlm_protocol.wire import MAX_RETRY_AFTER_S, parse_retry_after

FRAMES = tagged_frames(0, range(40), size=8)


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
    fake = FakeProxy(script=[error_response(429, "overloaded", retry_after="30")])
    async with client_for(fake, timeout=2.0, fail_on_request_error=True) as client:
        started = time.monotonic()
        with pytest.raises(RateLimitError) as caught:
            await client.score_episode(FRAMES, "t")
    assert time.monotonic() - started < 1.0
    assert caught.value.code == "overloaded" and caught.value.retry_after == 30


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


async def test_the_timeout_bounds_a_proxy_that_never_answers():
    """A real socket: the server reads the request and says nothing."""
    connections = []

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.read(1)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with AsyncRewardClient(endpoint=f"http://127.0.0.1:{port}/score", timeout=0.4,
                                     batch="never") as client:
            started = time.monotonic()
            result = await client.score_episode(FRAMES, "t", fallback=0.0)
            elapsed = time.monotonic() - started
    finally:
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()
    assert (result.ok, result.value, result.reason) == (False, 0.0, "timeout")
    assert isinstance(result.error, APITimeoutError) and 0.35 < elapsed < 2.0


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
class _SlowProxy(httpx.AsyncBaseTransport):
    """Answers after `delay` s: /score with a score, /score/batch with `batch_answer`."""

    def __init__(self, delay: float, batch_answer) -> None:
        self.delay, self.batch_answer, self.paths = delay, batch_answer, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(await request.aread())
        self.paths.append(request.url.path)
        if request.url.path == "/score/batch" and not body["items"]:
            return error_response(422, "invalid_request")  # the probe: batching is offered
        await asyncio.sleep(self.delay)
        if request.url.path == "/score/batch":
            return self.batch_answer(len(body["items"]))
        return httpx.Response(200, json={"score": 0.9})


def _items_overloaded(n: int) -> httpx.Response:
    return httpx.Response(200, json={"results": [
        {"index": i, "ok": False, "status": 429, "error": {"code": "overloaded", "retryable": True}}
        for i in range(n)]})


@pytest.mark.parametrize("batch_answer", [
    _items_overloaded, lambda n: error_response(413, "payload_too_large")])
async def test_a_batch_and_its_retries_end_within_the_calls_timeout(batch_answer):
    proxy = _SlowProxy(0.6, batch_answer)
    async with AsyncRewardClient(endpoint="http://proxy.test/score", http_transport=proxy,
                                 timeout=1.0, batch="auto") as client:
        started = time.monotonic()
        results = await client.score_episodes([(FRAMES, "a", 0.0), (FRAMES, "b", 0.0)])
        elapsed = time.monotonic() - started
    # explicitly failed: the retry (or the /score fallback) would have run past the timeout
    assert all((r.ok, r.value) == (False, 0.0) for r in results)
    assert {r.reason for r in results} <= {"overloaded", "timeout"}
    assert elapsed < 1.0 + 1.0  # the timeout plus the return margin


async def test_the_timeout_bounds_a_reply_that_drips_in():
    """A real socket: each byte arrives well within the timeout, the whole reply does not."""
    tasks, stop = [], asyncio.Event()

    async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        payload = b'{"score": 0.9}' + b" " * 26
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(payload))
        try:
            for byte in payload:  # 40 bytes, 0.1 s apart: 4 s in all
                if stop.is_set():
                    break
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(reader, writer):
        tasks.append(asyncio.current_task())
        await drip(reader, writer)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with AsyncRewardClient(endpoint=f"http://127.0.0.1:{port}/score", timeout=0.8,
                                     batch="never") as client:
            started = time.monotonic()
            result = await client.score_episode(FRAMES, "t", fallback=0.0)
            elapsed = time.monotonic() - started
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        server.close()
        await server.wait_closed()
    assert (result.ok, result.value, result.reason) == (False, 0.0, "timeout")
    assert isinstance(result.error, APITimeoutError) and elapsed < 1.6 * 0.8


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

    def slow_build(episode, cfg):
        entered.set()
        body = real(episode, cfg)
        built.append(body.temp_video)
        release.wait(10)
        return body

    monkeypatch.setattr(_base_client, "build_request_body", slow_build)
    fake = FakeProxy(batch=True)
    async with client_for(fake, transport="path", temp_video_dir=str(tmp_path),
                          batch=batch) as client:
        task = asyncio.ensure_future(client.score_episodes([(FRAMES, "t", 0.0)]))
        assert await asyncio.to_thread(entered.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        for _ in range(100):  # the thread finishes, then its temp MP4 goes
            if built and not list(tmp_path.iterdir()):
                break
            await asyncio.sleep(0.05)
    assert len(built) == 1 and built[0] is not None and list(tmp_path.iterdir()) == []
    assert fake.score_requests == []
