"""Endpoints added and removed at run time (GET/POST /admin/endpoints), against the real proxy on
loopback and fake vLLM servers: an added endpoint takes traffic, a removed one drains (its call in
flight ends 200, new calls go elsewhere, then it is gone everywhere), a backend with none left
answers 503 at once, the routes need the admin key, bad input changes nothing, and /metrics
and /health follow every change."""

from __future__ import annotations

import base64
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import QWEN_MODEL, QWEN_REPLY, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import HANG_S, free_port, wait_until

EPISODE = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56))}
QWEN = "qwen2_5_vl_vllm"
KEY = "adm1n-t0ken"


@pytest.fixture
def keyed_proxy(monkeypatch, proxy_factory, fake_primo, media_root):
    """A proxy with both keys (KEY the admin's, which may also score), its qwen backend on the given endpoints."""
    monkeypatch.setenv("PROXY_KEY", "sc0ring-t0ken")
    monkeypatch.setenv("PROXY_ADMIN_KEY", KEY)

    def make(qwen_urls: list[str], qwen: dict | None = None):
        data = libero_settings_dict(qwen_urls, [fake_primo.base_url], media_root, api_key_env="PROXY_KEY",
                                    admin_api_key_env="PROXY_ADMIN_KEY")
        data["backends"][QWEN].update(qwen or {})
        return proxy_factory(settings_from_dict(data))

    return make


def _client(server, token: str | None = KEY) -> httpx.Client:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=server.url, timeout=30, trust_env=False, headers=headers)


def _change(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/admin/endpoints", json={"backend": QWEN, **body})


def _listed(http: httpx.Client, backend: str = QWEN) -> dict[str, dict]:
    return {e["url"]: e for e in http.get("/admin/endpoints").json()["backends"][backend]}


def _health(http: httpx.Client, backend: str = QWEN) -> dict[str, dict]:
    return {e["url"]: e for e in http.get("/health").json()["backends"][backend]["endpoints"]}


def _metric(http: httpx.Client, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    found = re.search(rf"^{name}{{{re.escape(wanted)}}} (\S+)$", http.get("/metrics").text, re.M)
    return float(found.group(1)) if found else None


def test_an_endpoint_added_at_run_time_takes_traffic(keyed_proxy, fake_qwen, fake_vllm_factory, caplog):
    caplog.set_level(logging.INFO, logger="vlm_reward_proxy")
    added = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    server = keyed_proxy([fake_qwen.base_url])
    with _client(server) as http:
        answer = _change(http, add=[added.base_url])
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "backend": QWEN, "added": [added.base_url], "removed": [], "unchanged": [],
            "endpoints": [{"url": fake_qwen.base_url, "state": "closed", "in_flight": 0, "draining": False},
                          {"url": added.base_url, "state": "closed", "in_flight": 0, "draining": False}]}
        # present already (the trailing slash is the config's form too): a no-op, reported as such
        again = _change(http, add=[added.base_url + "/"]).json()
        assert again["added"] == [] and again["unchanged"] == [added.base_url] and len(again["endpoints"]) == 2
        for _ in range(4):  # no group key: least outstanding, ties in turn
            assert http.post("/score", json=EPISODE).status_code == 200
        assert len(added.chat_requests) == 2 and len(fake_qwen.chat_requests) == 2
        # the prober probes it from its next round on: /health shows it ready
        wait_until(lambda: _health(http).get(added.base_url, {}).get("ready"), HANG_S, "a probe of the added endpoint")
        assert _health(http)[added.base_url]["draining"] is False
        assert http.get("/admin/endpoints").json()["backends"]["PRIMO-R1"][0]["draining"] is False
    changes = [r for r in caplog.records if r.name == "vlm_reward_proxy" and "changed at run time" in r.getMessage()]
    assert len(changes) == 1 and changes[0].levelno == logging.INFO and added.base_url in changes[0].getMessage()


def test_a_removed_endpoint_drains_its_call_in_flight_then_leaves(keyed_proxy, fake_qwen, fake_vllm_factory):
    other = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    server = keyed_proxy([fake_qwen.base_url])
    gone = fake_qwen.base_url
    release = threading.Event()
    fake_qwen.script({"hold": release})
    with _client(server) as http, ThreadPoolExecutor(1) as pool, _client(server) as slow_http:
        try:
            slow = pool.submit(slow_http.post, "/score", json=EPISODE)
            wait_until(lambda: fake_qwen.fake.chats_in_progress == 1, HANG_S, "the slow call to reach its endpoint")
            answer = _change(http, add=[other.base_url], remove=[gone])  # a replica moved
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["added"] == [other.base_url] and body["removed"] == [gone] and body["unchanged"] == []
            assert body["endpoints"] == [
                {"url": gone, "state": "closed", "in_flight": 1, "draining": True},
                {"url": other.base_url, "state": "closed", "in_flight": 0, "draining": False}]
            assert _listed(http)[gone]["draining"] is True
            assert _health(http)[gone]["draining"] is True and _health(http)[gone]["ready"] is False
            assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="draining") == 1
            assert _change(http, remove=[gone]).json()["unchanged"] == [gone]  # draining already
            for _ in range(3):  # new calls go to the other endpoint only
                reply = http.post("/score", json=EPISODE)
                assert reply.status_code == 200 and reply.json()["endpoint"] == other.base_url
            assert fake_qwen.fake.state.chat_count == 1 and len(other.chat_requests) == 3
            assert not slow.done()
        finally:
            release.set()
        finished = slow.result(timeout=30)
        assert finished.status_code == 200 and finished.json()["endpoint"] == gone  # ended normally
        wait_until(lambda: gone not in _listed(http), HANG_S, "the drained endpoint to leave")
        assert list(_listed(http)) == [other.base_url]
        assert gone not in _health(http)
        wait_until(lambda: (QWEN, gone) not in server.app.state.prober.results, HANG_S,
                   "its probe result to be dropped")
        assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="draining") == 0
        assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="ready") == 1
        assert _metric(http, "vlm_proxy_endpoint_changes_total", backend=QWEN, change="removed") == 1
        assert _metric(http, "vlm_proxy_endpoint_in_flight", backend=QWEN, endpoint=gone) is None  # no stale series
        assert fake_qwen.fake.state.chat_count == 1


def test_no_endpoint_left_is_a_503_at_once_and_one_added_back_serves(keyed_proxy, fake_qwen):
    server = keyed_proxy([fake_qwen.base_url])
    with _client(server) as http:
        body = _change(http, remove=[fake_qwen.base_url]).json()
        assert body["removed"] == [fake_qwen.base_url] and body["endpoints"] == []  # nothing in flight: gone
        failed = http.post("/score", json=EPISODE)
        assert failed.status_code == 503 and failed.headers["retry-after"]
        error = failed.json()["error"]
        assert error["code"] == "upstream_unavailable" and error["retryable"] is True
        assert "no endpoints: all were removed at run time" in error["message"]
        assert "score" not in failed.json()
        health = http.get("/health").json()
        assert health["backends"][QWEN]["endpoints"] == [] and health["backends"][QWEN]["ready"] is False
        assert health["status"] == "degraded"  # the other backend still serves
        assert _change(http, add=[fake_qwen.base_url]).json()["added"] == [fake_qwen.base_url]
        assert http.post("/score", json=EPISODE).status_code == 200
        assert _metric(http, "vlm_proxy_endpoint_changes_total", backend=QWEN, change="added") == 1
        assert _metric(http, "vlm_proxy_endpoint_changes_total", backend=QWEN, change="removed") == 1


def test_the_admin_routes_need_the_admin_key(keyed_proxy, fake_qwen, proxy_server):
    server = keyed_proxy([fake_qwen.base_url])
    for token in (None, "wrong"):
        with _client(server, token) as http:
            assert http.get("/admin/endpoints").status_code == 401
            refused = _change(http, remove=[fake_qwen.base_url])
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    with _client(server) as http:
        assert list(_listed(http)) == [fake_qwen.base_url]  # nothing changed
    with _client(proxy_server, None) as http:  # a proxy without proxy.admin_api_key_env
        for answer in (http.get("/admin/endpoints"), _change(http, remove=[fake_qwen.base_url])):
            assert answer.status_code == 403, answer.text
            error = answer.json()["error"]
            assert error["code"] == "admin_disabled" and "proxy.admin_api_key_env" in error["message"]
        assert http.post("/score", json=EPISODE).status_code == 200  # its endpoint still serves


@pytest.mark.parametrize(("body", "status", "field", "words"), [
    ({"backend": QWEN, "add": ["ftp://10.0.0.7:8001/v1"]}, 422, "add.0", "must start with http:// or https://"),
    ({"backend": QWEN, "add": ["http:///v1"]}, 422, "add.0", "and a host"),
    ({"backend": QWEN, "add": [7]}, 422, "add.0", ""),
    ({"backend": QWEN, "add": [], "replace": []}, 422, "replace", ""),
    ({"backend": "nope", "add": ["http://127.0.0.1:1/v1"]}, 404, "backend", "unknown backend 'nope'"),
    ({"backend": QWEN, "remove": ["http://127.0.0.1:1/v1"]}, 422, "remove",
     "not an endpoint of backend 'qwen2_5_vl_vllm': http://127.0.0.1:1/v1"),
    ({"backend": QWEN, "add": ["{known}"], "remove": ["{known}/"]}, 422, "remove", "both added and removed: {known}"),
    (None, 422, "body", ""),
])
def test_bad_input_is_refused_and_changes_nothing(keyed_proxy, fake_qwen, body, status, field, words):
    server = keyed_proxy([fake_qwen.base_url])
    known = fake_qwen.base_url
    if body is not None:
        body = {k: [u.replace("{known}", known) if isinstance(u, str) else u for u in v] if isinstance(v, list)
                else v for k, v in body.items()}
    with _client(server) as http:
        before = http.get("/admin/endpoints").json()
        answer = (http.post("/admin/endpoints", json=body) if body is not None else
                  http.post("/admin/endpoints", content=b"{not json", headers={"content-type": "application/json"}))
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert error["field"] == field and words.replace("{known}", known) in error["message"]
        assert http.get("/admin/endpoints").json() == before
        assert _metric(http, "vlm_proxy_endpoint_changes_total", backend=QWEN, change="added") == 0
        assert _metric(http, "vlm_proxy_endpoint_changes_total", backend=QWEN, change="removed") == 0


def test_an_added_endpoint_is_probed_and_the_gauges_follow_its_circuit(keyed_proxy, fake_qwen):
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    server = keyed_proxy([fake_qwen.base_url], {"circuit": {"failures": 1, "cooldown_s": 60}})
    with _client(server) as http:
        assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="ready") == 1
        assert _metric(http, "vlm_proxy_endpoint_changes_total", backend=QWEN, change="added") == 0
        assert _change(http, add=[dead]).json()["added"] == [dead]
        assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="ready") == 2
        endpoint = wait_until(lambda: (e := _health(http).get(dead, {})).get("circuit") == "open" and e, HANG_S,
                              "a failed probe of the added endpoint to open its circuit")
        assert "connection refused" in endpoint["reason"]
        assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="open") == 1
        assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="ready") == 1
        assert _metric(http, "vlm_proxy_endpoint_changes_total", backend=QWEN, change="added") == 1
        assert _change(http, remove=[dead]).json()["endpoints"] == [
            {"url": fake_qwen.base_url, "state": "closed", "in_flight": 0, "draining": False}]
        assert _metric(http, "vlm_proxy_endpoints", backend=QWEN, state="open") == 0
        assert _metric(http, "vlm_proxy_circuit_open", backend=QWEN, endpoint=dead) is None
        assert (QWEN, dead) not in server.app.state.prober.results


def test_an_endpoint_added_with_credentials_never_shows_them(keyed_proxy, fake_qwen, fake_vllm_factory, caplog):
    # found by review (stop 36): the answer's lists and the proxy log carried the URL as the admin
    # sent it, password included; a new password for the same server was ignored
    caplog.set_level(logging.INFO, logger="vlm_reward_proxy")
    added = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    server = keyed_proxy([fake_qwen.base_url])
    with_password = added.base_url.replace("http://", "http://operator:{}@")
    with _client(server) as http:
        answer = _change(http, add=[with_password.format("first-s3cret")], remove=[fake_qwen.base_url])
        assert answer.status_code == 200, answer.text
        assert answer.json()["added"] == [added.base_url] and "s3cret" not in answer.text
        assert http.post("/score", json=EPISODE).status_code == 200
        again = _change(http, add=[with_password.format("second-s3cret")])
        assert again.json()["unchanged"] == [added.base_url] and "s3cret" not in again.text
        assert http.post("/score", json=EPISODE).status_code == 200
        listed = http.get("/admin/endpoints").text + http.get("/metrics").text + http.get("/health").text
    assert "s3cret" not in listed and "s3cret" not in caplog.text
    sent = [r.headers.get("authorization") for r in added.fake.state.requests if r.path == "/v1/chat/completions"]
    assert sent == ["Basic " + base64.b64encode(f"operator:{word}".encode()).decode()
                    for word in ("first-s3cret", "second-s3cret")]
