"""Issue 39, item 3: runs are kept apart. A scoring key limited to run A (proxy.run_keys) tries to
write run B's episodes, ground truth and references on every route that writes them, against the
real proxy on loopback with fake vLLM servers: each is a 403 `run_forbidden` naming the field and
the run, nothing reaches a replica, and run B's window, store and audit lines are what they were.
The limited key reads only its own runs; the unlimited key and the admin key keep working."""

from __future__ import annotations

import json

import httpx
import pytest

from proxy.config import settings_from_dict
from proxy.errors import ConfigError
from proxy.http.app import create_app
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, images_b64, npy_b64

QWEN = "qwen2_5_vl_vllm"
SCORING, ADMIN, RUN_A = "sc0ring-key", "adm1n-key", "run-a-key"
FRAMES = npy_b64(episode_frames(4, 56, 56))
EMBED_MODEL = "fake-embed"


def _episode(run: str | None, success: bool = True, task: str = "t1") -> dict:
    metadata = {"task_id": task, "env_success": success, **({"run": run} if run is not None else {})}
    return {"task_text": "put the bowl away", "frames_npy": FRAMES, "metadata": metadata}


def _compare(runs: tuple[str | None, str | None]) -> dict:
    return {"task_text": "t", "episodes": [{"frames_npy": FRAMES, "metadata": {"run": r} if r else {}} for r in runs]}


def _chat_score(run: str | None) -> dict:
    image = "data:image/png;base64," + images_b64(episode_frames(1, 56, 56))[0]
    return {"model": f"score:{QWEN}", "metadata": {"run": run, "task_id": "t1", "env_success": True},
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "image_url", "image_url": {"url": image}},
                                                      {"type": "text", "text": "put the bowl away"}]}]}


AUDIT = "audit.jsonl"


def _data(fake_qwen, fake_primo, fake_embed, media_root, tmp_path) -> dict:
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, api_key_env="PROXY_KEY",
                                admin_api_key_env="PROXY_ADMIN_KEY", audit_log=str(tmp_path / AUDIT),
                                run_keys=[{"key_env": "RUN_A_KEY", "runs": ["runA"], "run_prefixes": ["sweep-"]}])
    data["proxy"]["reference_store"] = {"dir": str(tmp_path / "references")}
    data["backends"]["embed"] = {"model": EMBED_MODEL, "kind": "embedding", "endpoints": [fake_embed.base_url],
                                 "frames": {"nframes": 4}}
    return data


@pytest.fixture
def keys(monkeypatch):
    for env, value in (("PROXY_KEY", SCORING), ("PROXY_ADMIN_KEY", ADMIN), ("RUN_A_KEY", RUN_A)):
        monkeypatch.setenv(env, value)


@pytest.fixture
def fake_embed(fake_vllm_factory):
    return fake_vllm_factory(served_model_name=EMBED_MODEL)


@pytest.fixture
def proxy(keys, proxy_factory, fake_qwen, fake_primo, fake_embed, media_root, tmp_path):
    return proxy_factory(settings_from_dict(_data(fake_qwen, fake_primo, fake_embed, media_root, tmp_path)))


def _client(server, key: str | None) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30, trust_env=False,
                        headers={"authorization": f"Bearer {key}"} if key else {})


def _windows(http: httpx.Client, run: str) -> list[dict]:
    return [k for k in http.get("/quality").json()["keys"] if k["key"]["run"] == run]


def _store(http: httpx.Client, namespace: str) -> list[dict]:
    return [t for t in http.get("/progress/references").json()["store"]["tasks"] if t["namespace"] == namespace]


def _progress(runs: list[str | None], namespace: str | None, **fields) -> dict:
    return {"items": [_episode(r, success=i == 0) for i, r in enumerate(runs)], "reference_namespace": namespace,
            **fields}


# Every write a key limited to run A may try on run B, and the field its 403 names.
FORBIDDEN = [
    ("/score", _episode("runB"), "metadata.run"),
    ("/score", _episode(None), "metadata.run"),  # no run: the unnamed run is not run A's either
    ("/score", _episode("sweep"), "metadata.run"),  # a prefix is a prefix: "sweep" is not "sweep-…"
    ("/score/batch", {"items": [_episode("runA"), _episode("runB")]}, "items[1].metadata.run"),
    ("/score/dense", {**_episode("runB"), "points": 2}, "metadata.run"),
    ("/compare", _compare(("runA", "runB")), "episodes[1].metadata.run"),
    ("/compare/batch", {"items": [_compare(("runA", "runA")), _compare(("runB", "runA"))]},
     "items[1].episodes[0].metadata.run"),
    ("/progress/batch", _progress(["runA", "runB"], "runA"), "items[1].metadata.run"),
    # run A's episodes, but run B's references: read (use_reference_store) and added to (remember_successes)
    ("/progress/batch", _progress(["runA", "runA"], "runB"), "reference_namespace"),
    ("/progress/batch", _progress(["runA", "runA"], None, use_reference_store=False), "reference_namespace"),
    ("/v1/chat/completions", _chat_score("runB"), "metadata.run"),
]


def test_a_key_limited_to_run_a_cannot_write_run_b(proxy, fake_qwen, fake_embed, tmp_path):
    with _client(proxy, SCORING) as owner, _client(proxy, RUN_A) as run_a:
        # Run B's state, written by the unlimited key: a window, a stored success.
        assert owner.post("/score", json=_episode("runB")).status_code == 200
        assert owner.post("/progress/batch", json=_progress(["runB", "runB"], "runB")).status_code == 200
        proxy.flush_audit()
        before = (_windows(owner, "runB"), _store(owner, "runB"), len(fake_qwen.chat_requests),
                  len(fake_embed.embedding_requests), (tmp_path / AUDIT).read_text())
        assert before[0] and before[1]

        for path, body, field in FORBIDDEN:
            answer = run_a.post(path, json=body)
            assert answer.status_code == 403, (path, field, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "run_forbidden" and error["field"] == field, (path, error)
            assert "'runA'" in error["message"] and "'sweep-'" in error["message"]

        proxy.flush_audit()
        assert (_windows(owner, "runB"), _store(owner, "runB"), len(fake_qwen.chat_requests),
                len(fake_embed.embedding_requests), (tmp_path / AUDIT).read_text()) == before


def test_a_limited_key_writes_its_own_runs_and_reads_only_them(proxy):
    with _client(proxy, SCORING) as owner, _client(proxy, RUN_A) as run_a, _client(proxy, ADMIN) as admin:
        assert owner.post("/score", json=_episode("runB")).status_code == 200
        assert owner.post("/progress/batch", json=_progress(["runB", "runB"], "runB")).status_code == 200
        for run in ("runA", "sweep-7"):  # a name, and a generated name under the prefix
            assert run_a.post("/score", json=_episode(run)).status_code == 200
        assert run_a.post("/score/batch", json={"items": [_episode("runA"), _episode("sweep-8")]}).status_code == 200
        # Past the key's check (the fake's reply holds a score, not a label: 502 unparseable_label).
        assert run_a.post("/compare", json=_compare(("runA", "sweep-1"))).json()["error"]["code"] == "unparseable_label"
        assert run_a.post("/progress/batch", json=_progress(["runA", "runA"], "runA")).status_code == 200
        # The admin key, and the unlimited scoring key, write any run as before.
        assert admin.post("/score", json=_episode("runC")).status_code == 200

        assert {k["key"]["run"] for k in owner.get("/quality").json()["keys"]} == {"runA", "sweep-7", "sweep-8",
                                                                                  "runB", "runC"}
        assert {k["key"]["run"] for k in run_a.get("/quality").json()["keys"]} == {"runA", "sweep-7", "sweep-8"}
        assert {t["namespace"] for t in run_a.get("/progress/references").json()["store"]["tasks"]} == {"runA"}
        assert {t["namespace"] for t in owner.get("/progress/references").json()["store"]["tasks"]} == {"runA",
                                                                                                        "runB"}
        metrics = run_a.get("/metrics").text
        assert 'run="runA"' in metrics and 'run="runB"' not in metrics and 'run="runC"' not in metrics
        assert 'run="runB"' in owner.get("/metrics").text
        # The pass-through writes no run's state: the limited key may use it.
        assert run_a.get("/v1/models").status_code == 200
    with _client(proxy, None) as nobody:
        assert nobody.post("/score", json=_episode("runA")).status_code == 401


@pytest.mark.parametrize(("run_keys", "env", "match"), [
    ([{"key_env": "RUN_A_KEY", "runs": []}], {}, "runs or run_prefixes"),
    ([{"key_env": "PROXY_KEY", "runs": ["a"]}], {}, "different variables"),
    ([{"key_env": "RUN_A_KEY", "runs": ["a"]}], {"RUN_A_KEY": SCORING}, "one value"),
    ([{"key_env": "RUN_A_KEY", "runs": ["a"]}], {"RUN_A_KEY": ""}, "unset or empty"),
])
def test_run_keys_are_checked_at_start(monkeypatch, fake_qwen, fake_primo, media_root, run_keys, env, match):
    monkeypatch.setenv("PROXY_KEY", SCORING)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=match):
        create_app(settings_from_dict(libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                                           api_key_env="PROXY_KEY", run_keys=run_keys)))


def test_with_only_run_keys_every_route_but_health_needs_one(monkeypatch, proxy_factory, fake_qwen, fake_primo,
                                                              media_root):
    monkeypatch.setenv("RUN_A_KEY", RUN_A)
    server = proxy_factory(settings_from_dict(libero_settings_dict(
        [fake_qwen.base_url], [fake_primo.base_url], media_root,
        run_keys=[{"key_env": "RUN_A_KEY", "runs": ["runA"]}])))
    with _client(server, None) as nobody, _client(server, RUN_A) as run_a:
        assert nobody.get("/health").status_code == 200
        assert nobody.post("/score", json=_episode("runA")).status_code == 401
        assert json.loads(run_a.post("/score", json=_episode("runA")).text)["backend"] == QWEN
