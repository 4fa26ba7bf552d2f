"""Issue 24, item 6: GET /health answers without a key, so on a keyed proxy it shows an anonymous
caller states and codes only: no upstream error text or server-chosen words, and never credentials
written in an endpoint URL (`http://user:password@host`), to anyone. A caller holding a key sees the
detailed reasons (as its error answers would), still without the credentials."""

from __future__ import annotations

import base64

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import QWEN_MODEL, QWEN_REPLY, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64

QWEN = "qwen2_5_vl_vllm"
SCORING, ADMIN = "sc0ring-key", "adm1n-key"
PASSWORD, UPSTREAM_WORDS = "pa55w0rd-in-url", "UPSTREAM-CHOSEN-WORDS"


@pytest.fixture
def leaky(monkeypatch, proxy_factory, fake_vllm_factory, fake_primo, media_root):
    """qwen on two endpoints: one written with credentials in its URL, one whose /v1/models lists a
    model the server named itself (its readiness reason quotes the server)."""
    monkeypatch.setenv("PROXY_KEY", SCORING)
    monkeypatch.setenv("PROXY_ADMIN_KEY", ADMIN)
    with_password = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    odd = fake_vllm_factory(served_model_name=QWEN_MODEL, models_body={"data": [{"id": UPSTREAM_WORDS}]})
    url = with_password.base_url.replace("http://", f"http://operator:{PASSWORD}@")
    data = libero_settings_dict([url, odd.base_url], [fake_primo.base_url], media_root, api_key_env="PROXY_KEY",
                                admin_api_key_env="PROXY_ADMIN_KEY")
    data["backends"][QWEN]["retry"]["attempts"] = 1  # a failed call is answered, not failed over
    server = proxy_factory(settings_from_dict(data))
    server.with_password = with_password  # the fake behind the URL with credentials
    return server


def _health(server, key: str | None) -> tuple[str, dict]:
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {key}"} if key else {}) as http:
        answer = http.get("/health")
    return answer.text, {e["url"].split("@")[-1]: e for e in answer.json()["backends"][QWEN]["endpoints"]}


def test_health_without_a_key_shows_codes_not_upstream_words_nor_credentials(leaky):
    text, endpoints = _health(leaky, None)
    assert PASSWORD not in text and UPSTREAM_WORDS not in text
    odd = next(e for e in endpoints.values() if not e["ready"])
    assert odd["reason_code"] == "model_not_served"
    assert odd["reason"].startswith(f"health probe: model {QWEN_MODEL!r} not served (")
    assert all("@" not in e["url"] for e in endpoints.values())  # the server, never its userinfo


@pytest.mark.parametrize("key", [SCORING, ADMIN])
def test_a_key_holder_sees_the_detail_but_never_credentials_in_urls(leaky, key):
    text, endpoints = _health(leaky, key)
    assert PASSWORD not in text
    odd = next(e for e in endpoints.values() if not e["ready"])
    assert odd["reason_code"] == "model_not_served" and UPSTREAM_WORDS in odd["reason"]


def test_credentials_in_an_endpoint_url_go_to_that_server_and_nowhere_else(leaky):
    # Answers, metrics and error messages name the endpoint: without its userinfo, which goes to
    # the server as HTTP basic auth (found by review: /score's `endpoint`, /metrics labels and a
    # 503's message showed the password to any scoring key).
    fake = leaky.with_password
    with httpx.Client(base_url=leaky.url, timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {SCORING}"}) as http:
        episode = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56))}
        scored = http.post("/score", json=episode)  # the other endpoint does not serve the model
        fake.script({"status": 500, "message": "broken"})
        failed = http.post("/score", json={**episode, "backend": QWEN})
        metrics = http.get("/metrics").text
    assert scored.status_code == 200, scored.text
    assert scored.json()["endpoint"] == fake.base_url
    assert failed.status_code == 503 and fake.base_url in failed.text
    for text in (scored.text, failed.text, metrics):
        assert PASSWORD not in text
    assert f'endpoint="{fake.base_url}"' in metrics
    basic = "Basic " + base64.b64encode(f"operator:{PASSWORD}".encode()).decode()
    assert {r.headers.get("authorization") for r in fake.fake.state.requests} == {basic}


def test_a_failing_endpoint_shows_anyone_a_code_and_a_keyed_caller_the_cause(
        monkeypatch, proxy_factory, fake_qwen, fake_primo, media_root):
    monkeypatch.setenv("PROXY_KEY", SCORING)
    # no probe round after start: a good probe would close the record of the failed call
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, api_key_env="PROXY_KEY",
                                health_interval_s=600)
    data["backends"][QWEN]["retry"] = {"attempts": 1, "parse_attempts": 1, "timeout_s": 10, "deadline_s": 30}
    data["backends"][QWEN]["circuit"] = {"failures": 1, "cooldown_s": 60}
    server = proxy_factory(settings_from_dict(data))
    fake_qwen.script({"status": 500, "message": UPSTREAM_WORDS})
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {SCORING}"}) as http:
        episode = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56))}
        assert http.post("/score", json=episode).status_code == 503
    _, endpoints = _health(server, SCORING)
    assert endpoints[fake_qwen.base_url]["reason_code"] == "requests_failing"
    assert UPSTREAM_WORDS in endpoints[fake_qwen.base_url]["reason"]
    text, endpoints = _health(server, None)
    assert UPSTREAM_WORDS not in text and endpoints[fake_qwen.base_url]["reason_code"] == "requests_failing"
    assert endpoints[fake_qwen.base_url]["reason"] == "requests failing (1 in a row)"


def test_files_on_disk_show_counts_to_anyone_and_paths_only_to_a_key_holder(
        monkeypatch, proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    monkeypatch.setenv("PROXY_KEY", SCORING)
    audit = tmp_path / "secret-dir" / "audit.jsonl"
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, api_key_env="PROXY_KEY",
                                audit_log=str(audit))
    server = proxy_factory(settings_from_dict(data))
    anonymous = httpx.get(server.url + "/health", timeout=30, trust_env=False)
    assert "secret-dir" not in anonymous.text
    assert set(anonymous.json()["audit"]) >= {"queued", "written", "dropped"}
    keyed = httpx.get(server.url + "/health", timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {SCORING}"})
    assert keyed.json()["audit"]["path"] == str(audit)
