"""Issue 9's edges: health probing in one place (API key, odd replies, circuit accounting, cache),
streams released however the client leaves, one error shape for everything, metrics that tell
the truth, start-up warnings, strict config."""

from __future__ import annotations

import json
import logging
import socket

import httpx
import pytest

from proxy.config import load_settings, settings_from_dict
from proxy.errors import ConfigError
from tests.conftest import QWEN_MODEL, QWEN_REPLY, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import HANG_S, wait_until

EPISODE = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56))}
QWEN = "qwen2_5_vl_vllm"


def _proxy(proxy_factory, qwen_urls, primo_url, media_root, qwen=None, **proxy):
    data = libero_settings_dict(qwen_urls, [primo_url], media_root, **proxy)
    data["backends"][QWEN].update(qwen or {})
    return proxy_factory(settings_from_dict(data))


def _endpoint(http: httpx.Client, index: int = 0) -> dict:
    return http.get("/health").json()["backends"][QWEN]["endpoints"][index]


# -- health probing ------------------------------------------------------------------------------
def test_the_probe_sends_the_backends_api_key(proxy_factory, fake_vllm_factory, fake_primo, media_root,
                                              monkeypatch):
    guarded = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY, api_key="k3y")
    monkeypatch.setenv("QWEN_KEY", "k3y")
    with_key = _proxy(proxy_factory, [guarded.base_url], fake_primo.base_url, media_root, {"api_key_env": "QWEN_KEY"})
    without = _proxy(proxy_factory, [guarded.base_url], fake_primo.base_url, media_root)
    with httpx.Client(base_url=with_key.url) as http:
        assert _endpoint(http)["ready"] is True and _endpoint(http)["circuit"] == "closed"
        assert http.post("/score", json=EPISODE).status_code == 200  # the chat call sends it too
    with httpx.Client(base_url=without.url) as http:
        endpoint = wait_until(lambda: (e := _endpoint(http))["circuit"] == "open" and e, HANG_S,
                              "repeated 401 probes to open the circuit")
    assert endpoint["ready"] is False and "401" in endpoint["reason"] and "api_key_env" in endpoint["reason"]


def test_an_odd_models_answer_is_not_ready_and_the_probe_loop_survives_it(proxy_factory, fake_vllm_factory,
                                                                         fake_primo, media_root):
    odd = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY, models_body={"data": None})
    server = _proxy(proxy_factory, [odd.base_url], fake_primo.base_url, media_root)
    with httpx.Client(base_url=server.url) as http:
        endpoint = _endpoint(http)
        assert endpoint["ready"] is False and "model list" in endpoint["reason"]
        odd.config.models_body = None  # the server answers normally again: later rounds still run
        wait_until(lambda: _endpoint(http)["ready"], HANG_S, "the probe loop to see the fixed server")


def test_one_failed_probe_does_not_open_the_circuit(proxy_factory, fake_vllm_factory, fake_primo, media_root):
    flaky = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    server = _proxy(proxy_factory, [flaky.base_url], fake_primo.base_url, media_root,
                    {"circuit": {"failures": 3, "cooldown_s": 60}})
    with httpx.Client(base_url=server.url) as http:
        flaky.config.healthy = False
        wait_until(lambda: not _endpoint(http)["ready"], HANG_S, "a failed probe")
        assert _endpoint(http)["circuit"] == "closed"  # one or two failures: still in rotation
        endpoint = wait_until(lambda: (e := _endpoint(http))["circuit"] == "open" and e, HANG_S,
                              "circuit.failures failed probes")
        assert "health probe: /health answered 503 (3 in a row)" in endpoint["reason"]
        flaky.config.healthy = True
        wait_until(lambda: _endpoint(http)["circuit"] == "closed", HANG_S, "a good probe to close it")


def test_a_call_answered_after_a_failed_probe_is_newer_evidence(proxy_factory, fake_vllm_factory, fake_primo,
                                                                media_root):
    # A server restarted between two probes: its last probe failed, then it answered a request.
    restarted = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY, healthy=False)
    server = _proxy(proxy_factory, [restarted.base_url], fake_primo.base_url, media_root,
                    {"circuit": {"failures": 3, "cooldown_s": 60}}, health_interval_s=60)  # no probe but the first
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert not _endpoint(http)["ready"] and http.get("/health").json()["status"] == "degraded"
        restarted.config.healthy = True
        episode = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56)), "backend": QWEN}
        assert http.post("/score", json=episode).status_code == 200
        endpoint = _endpoint(http)
        assert endpoint["ready"] and endpoint["reason"] is None and http.get("/health").json()["status"] == "ok"


def test_health_answers_from_the_probes_cache(proxy_factory, fake_qwen, fake_primo, media_root):
    server = _proxy(proxy_factory, [fake_qwen.base_url], fake_primo.base_url, media_root, health_interval_s=60)
    before = fake_qwen.fake.state.readiness_gets
    with httpx.Client(base_url=server.url) as http:
        for _ in range(20):
            assert http.get("/health").json()["status"] == "ok"
    assert fake_qwen.fake.state.readiness_gets == before  # 0 upstream GETs for 20 /health calls


def test_the_circuit_message_names_the_real_cause(proxy_factory, fake_vllm_factory, fake_primo, media_root):
    broken = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    broken.script(*[{"status": 500, "message": "CUDA out of memory"}] * 10)
    server = _proxy(proxy_factory, [broken.base_url], fake_primo.base_url, media_root, health_interval_s=60,
                    qwen={"circuit": {"failures": 2, "cooldown_s": 60}})
    with httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/score", json=EPISODE)  # 2 failures open the circuit; the other tries fail fast
        error = http.post("/score", json=EPISODE).json()["error"]
    assert error["code"] == "upstream_unavailable" and error["retryable"] is True and error["attempts"] == 0
    assert "CUDA out of memory" in error["message"] and "(2 in a row)" in error["message"]
    assert "health probe" not in error["message"]


# -- start-up and config -------------------------------------------------------------------------
def test_an_unreachable_backend_is_a_warning_with_the_next_step_at_startup(proxy_factory, fake_primo,
                                                                          media_root, caplog):
    caplog.set_level(logging.WARNING, logger="vlm_reward_proxy")
    _proxy(proxy_factory, ["http://127.0.0.1:9/v1"], fake_primo.base_url, media_root)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    [qwen] = [w for w in warnings if QWEN in w]
    assert "not reachable" in qwen and "make demo" in qwen and "vlm-reward-proxy up" in qwen
    assert not any("PRIMO-R1" in w for w in warnings)  # one warning per unready backend only


def test_a_duplicated_config_key_is_an_error_naming_it_and_its_line(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("backends:\n  b:\n    model: A\n    model: B\n    endpoints: [http://x/v1]\n"
                    "    layout: qwen_video\n    prompt: qwen_progress\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'model' at line 4 \(first at line 3\)"):
        load_settings(path)


# -- one error shape -----------------------------------------------------------------------------
def test_an_unexpected_exception_is_a_500_in_the_error_shape(proxy_server, client, caplog, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy_server.app.state.services.registry, "resolve", broken)  # undone after this test
    response = client.post("/score", json=EPISODE, headers={"x-request-id": "bug-1"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "bug-1"
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["request_id"] == "bug-1" and "RuntimeError" in error["message"]
    assert any(r.exc_info and "bug-1" in r.getMessage() for r in caplog.records)  # logged with its traceback
    metrics = client.get("/metrics").text
    assert 'vlm_proxy_requests_total{backend="none",outcome="internal_error",route="/score"} 1.0' in metrics


def test_a_body_that_is_not_json_is_a_422_naming_the_body(client):
    response = client.post("/score", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == "body" and error["message"].startswith("the request body is not valid JSON")
    assert "0:" not in error["message"]


def test_a_405_says_what_is_allowed(client):
    response = client.get("/score")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_every_failed_upstream_call_is_one_warning_line(client, fake_qwen, caplog):
    caplog.set_level(logging.WARNING, logger="vlm_reward_proxy.upstream")
    fake_qwen.script({"status": 503}, {"status": 502})
    assert client.post("/score", json=EPISODE).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "vlm_reward_proxy.upstream"]
    assert len(lines) == 2
    assert "attempt=1 code=upstream_unavailable" in lines[0] and "attempt=2" in lines[1]
    assert fake_qwen.base_url in lines[0]


def test_usage_is_returned(client):
    result = client.post("/score", json=EPISODE).json()
    assert result["usage"]["prompt_tokens"] > 0 and result["usage"]["completion_tokens"] > 0


# -- the OpenAI surface: streams and what the metrics say -------------------------------------------
def _in_flight(http: httpx.Client) -> int:
    return _endpoint(http)["in_flight"]


@pytest.mark.parametrize("when", ["before the first byte", "after the first byte"])
def test_a_client_leaving_a_stream_frees_the_slot_and_closes_upstream(client, proxy_server, fake_qwen, when):
    # vLLM's reply does not end while the test runs: a reply that ended on its own (after 30 s, or
    # five words 5 s apart) would free the slot and the call within the waits below even if the
    # proxy never noticed the client leave.
    action = ({"reply": "slow", "delay_s": 3600} if when == "before the first byte"
              else {"reply": "one two three four five", "word_delay_s": 3600})
    fake_qwen.script(action)
    body = json.dumps({"model": QWEN_MODEL, "messages": [{"role": "user", "content": "x"}],
                       "stream": True}).encode()
    # A raw socket: it can hang up at any moment, even before the response headers.
    with socket.create_connection(("127.0.0.1", proxy_server.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: proxy\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: fake_qwen.fake.chats_in_progress == 1, HANG_S, "the upstream call")
        if when == "after the first byte":
            assert sock.recv(1)
        assert _in_flight(client) == 1
    # the client is gone: the proxy releases the endpoint and hangs up on vLLM
    wait_until(lambda: _in_flight(client) == 0, HANG_S, "the endpoint slot to be released")
    wait_until(lambda: fake_qwen.fake.chats_in_progress == 0, HANG_S, "the upstream response to be closed")


def test_streamed_calls_and_relayed_4xx_are_counted_truthfully(client, fake_qwen):
    body = {"model": QWEN_MODEL, "messages": [{"role": "user", "content": "x"}]}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200 and b"[DONE]" in response.read()
    fake_qwen.script({"status": 400, "message": "bad request"})
    assert client.post("/v1/chat/completions", json=body).status_code == 400
    metrics = client.get("/metrics").text
    url = fake_qwen.base_url
    assert f'vlm_proxy_upstream_calls_total{{backend="{QWEN}",endpoint="{url}",result="ok"}} 1.0' in metrics
    assert (f'vlm_proxy_upstream_calls_total{{backend="{QWEN}",endpoint="{url}",result="upstream_rejected"}} 1.0'
            in metrics)
    assert f'vlm_proxy_requests_total{{backend="{QWEN}",outcome="http_400",route="/v1/chat/completions"}} 1.0' \
        in metrics


async def test_a_batch_request_is_counted_under_its_route_and_its_items_as_episodes(proxy_server, fake_qwen):
    async with httpx.AsyncClient(base_url=proxy_server.url, timeout=30) as http:
        await http.post("/score/batch", json={"items": [EPISODE, {**EPISODE, "backend": "nope"}]})
        metrics = (await http.get("/metrics")).text
    assert f'vlm_proxy_requests_total{{backend="{QWEN}",outcome="ok",route="/score/batch"}} 1.0' in metrics
    assert f'vlm_proxy_episodes_total{{backend="{QWEN}",outcome="ok"}} 1.0' in metrics
    assert 'vlm_proxy_episodes_total{backend="none",outcome="unknown_backend"} 1.0' in metrics
