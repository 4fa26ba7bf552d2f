"""Upstream failures through the real stack: retried, then answered with an explicit error."""

import concurrent.futures
import threading

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import QWEN_MODEL, QWEN_REPLY, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import HANG_S, release_when, wait_until

EPISODE = {"task_text": "stack the blocks", "frames_npy": npy_b64(episode_frames(8, 64, 64))}


def test_three_503s_then_success(client, fake_qwen):
    fake_qwen.script(*[{"status": 503}] * 3)
    response = client.post("/score", json=EPISODE)
    assert response.status_code == 200, response.text
    assert response.json()["attempts"] == 4
    assert len(fake_qwen.chat_requests) == 4


def test_two_unparseable_replies_then_success(proxy_factory, fake_qwen, fake_primo, media_root):
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root)
    data["backends"]["qwen2_5_vl_vllm"]["retry"]["parse_attempts"] = 3
    data["backends"]["qwen2_5_vl_vllm"]["retry"]["reask"] = {"temperature": 0.4, "top_p": 0.9}
    server = proxy_factory(settings_from_dict(data))
    fake_qwen.script({"reply": "I am not sure."}, {"reply": "between 30 and 40"}, {"reply": "<score>35</score>"})
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", json=EPISODE)
    assert response.status_code == 200, response.text
    result = response.json()
    assert result["score"] == pytest.approx(0.35) and (result["attempts"], result["asks"]) == (3, 3)
    sent = [(b["temperature"], b["top_p"], b["seed"]) for b in fake_qwen.chat_requests]
    assert sent == [(0.0, 1.0, 0), (0.4, 0.9, 1), (0.4, 0.9, 2)]  # each re-ask can change the answer
    assert (result["sampling"]["temperature"], result["sampling"]["seed"]) == (0.4, 2)  # what the scored reply had


def test_a_reask_is_never_the_same_request(client, fake_qwen):
    fake_qwen.script({"reply": "no idea"}, {"reply": "<score>20</score>"})
    assert client.post("/score", json=EPISODE).status_code == 200
    first, second = fake_qwen.chat_requests
    assert first != second and second["temperature"] > 0 and second["seed"] != first["seed"]
    assert first["messages"] == second["messages"]


def test_unparseable_every_time_is_an_explicit_502_never_zero(client, fake_qwen):
    fake_qwen.script({"reply": "no idea"}, {"reply": "The robot reached step 2 of 3, 75% done."})
    response = client.post("/score", json=EPISODE)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "unparseable_score" and error["attempts"] == 2 and error["retryable"] is False
    assert error["output_text"] == "The robot reached step 2 of 3, 75% done."  # what the model said
    assert "score" not in response.json()


def test_truncated_think_is_reported_as_cut_at_max_tokens(client, fake_primo):
    cut = {"reply": "<think><planning>1. grasp 2. lift 3. place at 30 cm", "finish_reason": "length"}
    fake_primo.script(cut, cut)
    response = client.post("/score", json={**EPISODE, "backend": "PRIMO-R1"})
    assert response.status_code == 502
    assert "finish_reason=length" in response.json()["error"]["message"]


def test_absurd_retry_after_is_capped_not_a_500(client, fake_qwen):
    fake_qwen.script(*[{"status": 503, "retry_after": "1e999"}] * 4)
    response = client.post("/score", json=EPISODE)
    assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_unavailable"
    assert 1 <= int(response.headers["retry-after"]) <= 3600


def test_exhausted_503s_answer_503_with_attempts_and_retry_after(client, fake_qwen):
    fake_qwen.script(*[{"status": 503, "retry_after": 0}] * 4)
    response = client.post("/score", json=EPISODE)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "upstream_unavailable"
    assert response.json()["error"]["attempts"] == 4
    assert "retry-after" in response.headers


@pytest.mark.parametrize("fault", [{"drop": True}, {"malformed": True}, {"truncated": True}, {"status": 429}])
def test_broken_replies_are_retried(client, fake_qwen, fault):
    fake_qwen.script(fault)
    response = client.post("/score", json=EPISODE)
    assert response.status_code == 200, response.text
    assert response.json()["attempts"] == 2


def test_slow_upstream_times_out_with_504(proxy_factory, fake_qwen, fake_primo, media_root):
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root)
    data["backends"]["qwen2_5_vl_vllm"]["retry"].update(timeout_s=0.2, attempts=2)
    server = proxy_factory(settings_from_dict(data))
    # No reply while the test runs: a fixed 1 s delay could arrive first if the 0.2 s timer fired late.
    fake_qwen.script({"hang_s": 3600}, {"hang_s": 3600})
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", json=EPISODE)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "upstream_timeout" and response.json()["error"]["attempts"] == 2


def test_unreachable_backend_is_503_not_a_hang(proxy_factory, fake_primo, media_root):
    data = libero_settings_dict(["http://127.0.0.1:9/v1"], [fake_primo.base_url], media_root)
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", json=EPISODE)
    assert response.status_code == 503 and response.json()["error"]["code"] == "upstream_unavailable"


def test_untrusting_vllm_gives_a_clear_error_naming_the_flag_and_no_retry_loop(
        proxy_factory, fake_vllm_factory, fake_primo, media_root):
    stock = fake_vllm_factory(served_model_name="Qwen2.5-VL-7B-Instruct", trust_request_mm_kwargs=False)
    server = proxy_factory(settings_from_dict(
        libero_settings_dict([stock.base_url], [fake_primo.base_url], media_root)))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", json=EPISODE)
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "upstream_refuses_mm_kwargs"
    assert "--trust-request-mm-kwargs" in error["message"] and error["attempts"] == 1
    assert len(stock.chat_requests) == 1


def test_request_mm_kwargs_off_works_against_an_untrusting_server(
        proxy_factory, fake_vllm_factory, fake_primo, media_root):
    stock = fake_vllm_factory(served_model_name="Qwen2.5-VL-7B-Instruct", trust_request_mm_kwargs=False,
                              default_text="<score>10</score>")
    data = libero_settings_dict([stock.base_url], [fake_primo.base_url], media_root)
    data["backends"]["qwen2_5_vl_vllm"]["request_mm_kwargs"] = False
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        response = http.post("/score", json=EPISODE)
    assert response.status_code == 200, response.text
    assert "media_io_kwargs" not in stock.chat_requests[-1]


def test_replica_failover_retries_on_the_other_endpoint(proxy_factory, fake_vllm_factory, fake_primo, media_root):
    first = fake_vllm_factory(served_model_name="Qwen2.5-VL-7B-Instruct", default_text=QWEN_REPLY)
    second = fake_vllm_factory(served_model_name="Qwen2.5-VL-7B-Instruct", default_text=QWEN_REPLY)
    first.script(*[{"status": 503}] * 10)
    second.script(*[{"status": 503}] * 10)
    server = proxy_factory(settings_from_dict(
        libero_settings_dict([first.base_url, second.base_url], [fake_primo.base_url], media_root)))
    second.fake.state.actions.clear()  # only the first replica is failing
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for _ in range(4):
            assert http.post("/score", json=EPISODE).status_code == 200
    # every failure on the first replica was followed by a retry on the second
    assert len(second.chat_requests) >= 4


def test_waiting_for_a_busy_replica_ends_at_the_callers_budget(proxy_factory, fake_vllm_factory, fake_primo,
                                                              media_root):
    # One in-flight slot, taken by a call the fake holds until the second request has its answer:
    # the second waits in the queue and must get its 504 when its 5 s budget runs out, not be sent
    # once the slot frees (the caller gave up long before). Were the wait unbounded, nothing would
    # answer it until release_when's hang bound let the first call go, and it would then be scored.
    fake = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    release = threading.Event()
    fake.script({"hold": release})
    data = libero_settings_dict([fake.base_url], [fake_primo.base_url], media_root)
    data["backends"]["qwen2_5_vl_vllm"]["admission"] = {"max_in_flight_per_endpoint": 1, "max_queue": 8}
    server = proxy_factory(settings_from_dict(data))
    answered = threading.Event()
    with (release_when(answered.is_set, release, HANG_S, "the queued request answered") as seen,
          httpx.Client(base_url=server.url, timeout=HANG_S * 2) as http,
          concurrent.futures.ThreadPoolExecutor(1) as pool):
        first = pool.submit(http.post, "/score", json=EPISODE)
        wait_until(lambda: fake.fake.state.chat_count == 1, HANG_S, "the first call reached the fake")
        second = http.post("/score", json=EPISODE, headers={"x-reward-budget-ms": "5000"})
        answered.set()
        first = first.result()
    assert seen["met"]
    assert second.status_code == 504, second.text
    error = second.json()["error"]
    assert error["code"] == "upstream_timeout" and "no in-flight slot" in error["message"], error
    assert error["attempts"] == 0 and error["retryable"] is True  # nothing reached vLLM: safe to ask again
    assert first.status_code == 200, first.text
    assert fake.fake.state.chat_count == 1  # the queued request was never sent
