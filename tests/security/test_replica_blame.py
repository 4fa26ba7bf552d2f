"""Replicas are judged on their own behaviour (issue 24, item 4), and endpoints removed at run time
leave /metrics (item 6).

A caller's short budget (x-reward-budget-ms) cuts the wait for a replica short: that timeout is the
caller's, answered as an explicit upstream_timeout, and never counts towards the replica's circuit.
Only a wait of the full per-call `timeout_s` does (with connection failures and 5xx), and
vlm_proxy_upstream_timeouts_total keeps the two causes apart.

Each test starts its own proxy: circuits and counters are per process, and each needs its own
retry/circuit settings. The fake holds its replies on an Event the test sets, so "slower than the
budget" is a fact, not a race; the probe interval is an hour, so no probe closes a circuit for us.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import QWEN_MODEL, QWEN_REPLY
from tests.fakes.processes import metric_sum, metrics
from tests.faults.common import BACKEND, EPISODE, one_backend
from vlm_protocol.wire import BUDGET_HEADER

NO_PROBES = 3600.0  # only the start-up probe: a circuit's state is what the calls made it


@pytest.fixture
def replica(fake_vllm_factory):
    return fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)


@pytest.fixture
def released():
    """An Event the fake's held replies wait on; set at teardown so no handler waits past the test."""
    event = threading.Event()
    yield event
    event.set()


def _proxy(proxy_factory, urls: list[str], media_root, retry: dict, **proxy):
    data = one_backend(urls, media_root, retry=retry, health_interval_s=NO_PROBES, **proxy)
    data["backends"][BACKEND]["circuit"] = {"failures": 3, "cooldown_s": 600}
    return proxy_factory(settings_from_dict(data))


def _endpoint(http: httpx.Client, url: str) -> dict:
    return next(e for e in http.get("/health").json()["backends"][BACKEND]["endpoints"] if e["url"] == url)


def test_short_budgets_time_out_for_the_caller_without_opening_a_healthy_replicas_circuit(
        proxy_factory, replica, released, media_root):
    proxy = _proxy(proxy_factory, [replica.base_url], media_root,
                   retry={"attempts": 4, "timeout_s": 10, "deadline_s": 30})
    replica.script(*[{"hold": released}] * 32)  # busy: answers only once the test lets it
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        answers = [http.post("/score", json=EPISODE, headers={BUDGET_HEADER: "300"}) for _ in range(8)]
        assert [(a.status_code, a.json()["error"]["code"]) for a in answers] == [(504, "upstream_timeout")] * 8
        endpoint = _endpoint(http, replica.base_url)
        assert endpoint["circuit"] == "closed" and endpoint["ready"] is True, endpoint
        assert http.get("/health").json()["backends"][BACKEND]["ready"] is True
        values = metrics(http, proxy.url)
        calls = replica.fake.state.chat_count
        assert metric_sum(values, "vlm_proxy_upstream_timeouts_total", cause="deadline") == calls >= 8
        assert metric_sum(values, "vlm_proxy_upstream_timeouts_total", cause="timeout") == 0
        assert metric_sum(values, "vlm_proxy_circuit_open") == 0
        released.set()
        replica.fake.state.actions.clear()
        full = http.post("/score", json=EPISODE)  # no budget: the replica's own pace is fine
        assert full.status_code == 200 and full.json()["score"] == 0.75, full.text


def test_a_replica_that_outlasts_the_full_timeout_still_opens_its_circuit(
        proxy_factory, replica, released, media_root):
    proxy = _proxy(proxy_factory, [replica.base_url], media_root,
                   retry={"attempts": 3, "parse_attempts": 1, "timeout_s": 0.2, "deadline_s": 30})
    replica.script(*[{"hold": released}] * 8)  # hangs past every call's own timeout_s
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as http:
        answer = http.post("/score", json=EPISODE)
        assert answer.status_code == 504 and answer.json()["error"]["code"] == "upstream_timeout"
        endpoint = _endpoint(http, replica.base_url)
        assert endpoint["circuit"] == "open" and endpoint["ready"] is False, endpoint
        values = metrics(http, proxy.url)
        assert metric_sum(values, "vlm_proxy_upstream_timeouts_total", cause="timeout") == 3
        assert metric_sum(values, "vlm_proxy_upstream_timeouts_total", cause="deadline") == 0
        after = http.post("/score", json=EPISODE)  # out of rotation: refused at once, no upstream call
        assert after.status_code == 503 and after.json()["error"]["code"] == "upstream_unavailable"


def test_an_endpoint_removed_at_run_time_leaves_every_series_of_metrics(
        proxy_factory, replica, fake_vllm_factory, released, media_root, monkeypatch):
    monkeypatch.setenv("PROXY_KEY", "sc0ring-t0ken")
    monkeypatch.setenv("PROXY_ADMIN_KEY", "adm1n-t0ken")
    proxy = _proxy(proxy_factory, [replica.base_url], media_root, retry={"timeout_s": 10},
                   api_key_env="PROXY_KEY", admin_api_key_env="PROXY_ADMIN_KEY")
    extra = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False,
                      headers={"authorization": "Bearer adm1n-t0ken"}) as http:
        def change(**body) -> None:
            answer = http.post("/admin/endpoints", json={"backend": BACKEND, **body})
            assert answer.status_code == 200, answer.text

        change(add=[extra.base_url], remove=[replica.base_url])  # every call now goes to `extra`
        assert http.post("/score", json=EPISODE).status_code == 200
        extra.script({"hold": released})
        assert http.post("/score", json=EPISODE, headers={BUDGET_HEADER: "300"}).status_code == 504
        named = [line for line in http.get("/metrics").text.splitlines() if extra.base_url in line]
        assert any(line.startswith("vlm_proxy_upstream_calls_total{") for line in named), named
        assert any(line.startswith("vlm_proxy_upstream_timeouts_total{") for line in named), named
        change(add=[replica.base_url], remove=[extra.base_url])
        text = http.get("/metrics").text
        assert extra.base_url not in text
        assert http.post("/score", json=EPISODE).status_code == 200  # the backend goes on, on `replica`
        assert metric_sum(metrics(http, proxy.url), "vlm_proxy_requests_total", route="/score") == 3
