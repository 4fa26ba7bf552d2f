"""Issue 24, item 1: a scoring key is not an admin key. Attacks a training worker holding the
scoring key could make on today's main (one key for everything), against the real proxy on
loopback and fake vLLM servers: adding its own server as a replica (which would then receive the
backend's vLLM key and every frame), writing demonstrations into the reference store. Each is
answered 403 `admin_key_required` and changes nothing; the admin key still works (and scores)."""

from __future__ import annotations

import httpx
import pytest

from proxy.config import settings_from_dict
from proxy.config.endpoint_hosts import check_endpoint_host
from proxy.errors import ConfigError, EndpointHostForbidden
from proxy.http.app import create_app
from tests.conftest import QWEN_MODEL, QWEN_REPLY, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import HANG_S, wait_until

QWEN = "qwen2_5_vl_vllm"
SCORING, ADMIN, BACKEND_KEY = "sc0ring-key", "adm1n-key", "vllm-backend-key"
EPISODE = {"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56))}
DEMO = {"task_id": "t1", "items": [{"task_text": "t", "frames_npy": npy_b64(episode_frames(4, 56, 56))}]}


def _data(fake_qwen, fake_primo, media_root, tmp_path, **proxy) -> dict:
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, **proxy)
    data["backends"][QWEN]["api_key_env"] = "QWEN_KEY"
    data["proxy"]["reference_store"] = {"dir": str(tmp_path / "references")}
    return data


@pytest.fixture
def keys(monkeypatch):
    for env, value in (("PROXY_KEY", SCORING), ("PROXY_ADMIN_KEY", ADMIN), ("QWEN_KEY", BACKEND_KEY)):
        monkeypatch.setenv(env, value)


@pytest.fixture
def two_key_proxy(keys, proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    """Both keys; qwen's vLLM key set (the config's fakes accept any)."""
    return proxy_factory(settings_from_dict(_data(fake_qwen, fake_primo, media_root, tmp_path, api_key_env="PROXY_KEY",
                                                  admin_api_key_env="PROXY_ADMIN_KEY", health_interval_s=0.1)))


def _client(server, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30, trust_env=False,
                        headers={"authorization": f"Bearer {key}"} if key else {})


def _urls(http: httpx.Client) -> list[str]:
    return [e["url"] for e in http.get("/admin/endpoints").json()["backends"][QWEN]]


def test_the_scoring_key_cannot_add_a_replica_and_the_attackers_server_hears_nothing(
        two_key_proxy, fake_vllm_factory, fake_qwen):
    attacker = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY)
    with _client(two_key_proxy, SCORING) as worker, _client(two_key_proxy, ADMIN) as admin:
        for answer in (worker.post("/admin/endpoints", json={"backend": QWEN, "add": [attacker.base_url]}),
                       worker.get("/admin/endpoints"), worker.post("/progress/references", json=DEMO)):
            assert answer.status_code == 403, answer.text
            error = answer.json()["error"]
            assert error["code"] == "admin_key_required" and "admin key" in error["message"]
        assert _urls(admin) == [fake_qwen.base_url]
        assert admin.get("/progress/references").json()["store"]["tasks"] == []
        # Two probe rounds after the attempt (the config's fake saw them), and scoring calls: none reached it.
        seen = fake_qwen.fake.state.readiness_gets
        wait_until(lambda: fake_qwen.fake.state.readiness_gets >= seen + 4, HANG_S, "two probe rounds")
        assert all(worker.post("/score", json=EPISODE).status_code == 200 for _ in range(3))
        assert attacker.fake.state.readiness_gets == 0 and attacker.fake.state.chat_count == 0


def test_an_endpoint_the_admin_adds_gets_the_backends_key_and_the_admin_key_scores(
        two_key_proxy, fake_vllm_factory, fake_qwen):
    guarded = fake_vllm_factory(served_model_name=QWEN_MODEL, default_text=QWEN_REPLY, api_key=BACKEND_KEY)
    with _client(two_key_proxy, ADMIN) as admin:
        changed = admin.post("/admin/endpoints", json={"backend": QWEN, "add": [guarded.base_url],
                                                       "remove": [fake_qwen.base_url]})
        assert changed.status_code == 200, changed.text
        # /v1/models answers only with the backend's key: ready means the probe sent it
        wait_until(lambda: admin.get("/health").json()["backends"][QWEN]["ready"], HANG_S, "the added endpoint ready")
        scored = admin.post("/score", json={**EPISODE, "backend": QWEN})  # the admin key scores too
        assert scored.status_code == 200, scored.text
        (request,) = guarded.fake.state.requests
        assert request.headers["authorization"] == f"Bearer {BACKEND_KEY}"


@pytest.mark.parametrize("key", [None, "wrong"])
def test_no_key_or_a_wrong_one_is_401_on_the_admin_routes(two_key_proxy, fake_qwen, key):
    with _client(two_key_proxy, key) as http:
        for answer in (http.get("/admin/endpoints"), http.post("/progress/references", json=DEMO),
                       http.post("/admin/endpoints", json={"backend": QWEN, "remove": [fake_qwen.base_url]})):
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized"


def test_only_an_admin_key_proxy_still_needs_it_on_admin_routes_and_scores_without_one(
        keys, proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    server = proxy_factory(settings_from_dict(_data(fake_qwen, fake_primo, media_root, tmp_path,
                                                    admin_api_key_env="PROXY_ADMIN_KEY")))
    with _client(server, None) as anyone, _client(server, "wrong") as wrong, _client(server, ADMIN) as admin:
        assert anyone.post("/score", json=EPISODE).status_code == 200  # no scoring key configured
        assert anyone.get("/admin/endpoints").status_code == 401
        assert wrong.post("/admin/endpoints", json={"backend": QWEN, "remove": [fake_qwen.base_url]}).status_code == 401
        assert admin.get("/admin/endpoints").status_code == 200


def test_without_an_admin_key_the_admin_routes_are_off_even_for_the_scoring_key(
        keys, proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    server = proxy_factory(settings_from_dict(_data(fake_qwen, fake_primo, media_root, tmp_path,
                                                    api_key_env="PROXY_KEY")))
    with _client(server, SCORING) as worker:
        for answer in (worker.get("/admin/endpoints"), worker.post("/progress/references", json=DEMO)):
            assert answer.status_code == 403 and answer.json()["error"]["code"] == "admin_disabled"
        assert worker.post("/score", json=EPISODE).status_code == 200


def test_one_key_for_both_is_refused_at_load(keys, monkeypatch, fake_qwen, fake_primo, media_root, tmp_path):
    with pytest.raises(ConfigError, match="admin_api_key_env must name another variable"):
        settings_from_dict(_data(fake_qwen, fake_primo, media_root, tmp_path, api_key_env="PROXY_KEY",
                                 admin_api_key_env="PROXY_KEY"))
    monkeypatch.setenv("PROXY_ADMIN_KEY", SCORING)  # two variables, one value
    settings = settings_from_dict(_data(fake_qwen, fake_primo, media_root, tmp_path, api_key_env="PROXY_KEY",
                                        admin_api_key_env="PROXY_ADMIN_KEY"))
    with pytest.raises(ConfigError, match="every scoring client would be an admin"):
        create_app(settings)


def test_admin_endpoint_hosts_limit_what_the_admin_may_add(keys, proxy_factory, fake_vllm_factory, fake_qwen,
                                                          fake_primo, media_root, tmp_path):
    server = proxy_factory(settings_from_dict(_data(
        fake_qwen, fake_primo, media_root, tmp_path, api_key_env="PROXY_KEY", admin_api_key_env="PROXY_ADMIN_KEY",
        admin_endpoint_hosts=["127.0.0.0/8", "localhost"])))
    other = fake_vllm_factory(served_model_name=QWEN_MODEL)
    with _client(server, ADMIN) as admin:
        for url in ("http://10.1.2.3:8000/v1", "http://gpu-7.internal:8000/v1",
                    f"http://127.0.0.1@10.1.2.3:{other.port}/v1", f"http://localhost.:{other.port}/v1"):
            refused = admin.post("/admin/endpoints", json={"backend": QWEN, "add": [url]})
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "endpoint_host_forbidden"
        assert _urls(admin) == [fake_qwen.base_url]
        added = admin.post("/admin/endpoints", json={"backend": QWEN, "add": [other.base_url,
                                                                            f"http://localhost:{other.port}/v1"]})
        assert added.status_code == 200 and len(added.json()["added"]) == 2


@pytest.mark.parametrize(("url", "allowed", "ok"), [
    ("http://10.0.0.7:8001/v1", ["10.0.0.0/8"], True),
    ("http://10.0.0.7:8001/v1", None, True),  # unset: any host
    ("http://11.0.0.7:8001/v1", ["10.0.0.0/8"], False),
    ("http://[::1]:8001/v1", ["::1/128"], True),
    ("http://node-1:8001/v1", ["node-1"], True),
    ("http://NODE-1:8001/v1", ["node-1"], True),  # host names are case-insensitive
    ("http://node-1.evil.example:8001/v1", ["node-1"], False),
    ("http://node-1:8001/v1", ["10.0.0.0/8"], False),  # a name is never resolved into a network
    ("http://2130706433:8001/v1", ["127.0.0.0/8"], False),  # odd address spellings fail closed
    ("http://10.0.0.7\\@evil.example/v1", ["10.0.0.0/8"], False),
    ("http://user:pw@10.0.0.7:8001/v1", ["10.0.0.0/8"], False),
])
def test_endpoint_hosts_compare_literally_and_fail_closed(url, allowed, ok):
    if ok:
        check_endpoint_host(url, allowed)
    else:
        with pytest.raises(EndpointHostForbidden):
            check_endpoint_host(url, allowed)


@pytest.mark.parametrize(("path", "methods"), [("/admin/endpoints", {"GET", "POST"}),
                                               ("/progress/references", {"GET", "POST"}), ("/score", {"POST"})])
def test_a_wrong_method_is_405_naming_every_method_of_the_path(two_key_proxy, path, methods):
    """FastAPI registers one route per method; Starlette's 405 named the first route's alone."""
    with _client(two_key_proxy, ADMIN) as http:
        for method in ("OPTIONS", "PUT", "DELETE"):
            answer = http.request(method, path)
            assert answer.status_code == 405 and answer.json()["error"]["code"] == "method_not_allowed"
            assert {m.strip() for m in answer.headers["allow"].split(",")} - {"HEAD"} == methods


def test_the_api_document_states_the_admin_refusals(two_key_proxy):
    with _client(two_key_proxy, SCORING) as http:
        paths = http.get("/openapi.json").json()["paths"]
    for path, method in (("/admin/endpoints", "get"), ("/admin/endpoints", "post"), ("/progress/references", "post")):
        refused = paths[path][method]["responses"]["403"]["description"]
        assert "admin_key_required" in refused and "admin_disabled" in refused
    assert "endpoint_host_forbidden" in paths["/admin/endpoints"]["post"]["responses"]["403"]["description"]
    assert "reference_keys_full" in paths["/progress/references"]["post"]["responses"]["409"]["description"]
