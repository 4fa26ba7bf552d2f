"""POST /progress/batch and /progress/references through the real proxy against the fake vLLM's
/v1/embeddings (its vector: the mean colour of the frames sent, so an episode's colour is its
place in the embedding space): the SRPO math against the independent oracle, what vLLM receives,
explicit no-reference results, per-task failure isolation, bad input, and the reference store."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from sklearn.cluster import DBSCAN
from sklearn.preprocessing import StandardScaler

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import npy_b64
from tests.reference.srpo_oracle import siirl_rewards

EMBED_MODEL = "fake-embed"


def solid(level: tuple[int, int, int], count: int = 4) -> str:
    frames = np.empty((count, 56, 56, 3), dtype=np.uint8)
    frames[:] = level
    return npy_b64(frames)


def item(task: object, success: bool | None, level: tuple[int, int, int], **extra: object) -> dict:
    metadata = {"task_id": task} if task is not None else {}
    if success is not None:
        metadata["env_success"] = success
    return {"task_text": f"task {task}", "frames_npy": solid(level), "fps": 20, "metadata": metadata, **extra}


@pytest.fixture
def fake_embed(fake_vllm_factory):
    return fake_vllm_factory(served_model_name=EMBED_MODEL)


def _settings(fake_qwen, fake_primo, fake_embed, media_root, **proxy):
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, **proxy)
    data["backends"]["embed"] = {
        "model": EMBED_MODEL, "kind": "embedding", "endpoints": [fake_embed.base_url],
        "retry": {"attempts": 3, "backoff_s": [0.01, 0.02], "timeout_s": 10, "deadline_s": 30},
        "frames": {"nframes": 4}}
    return settings_from_dict(data)


@pytest.fixture
def progress_client(proxy_factory, fake_qwen, fake_primo, fake_embed, media_root, tmp_path):
    audit = tmp_path / "audit.jsonl"
    server = proxy_factory(_settings(fake_qwen, fake_primo, fake_embed, media_root, audit_log=str(audit)))
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as http:
        http.audit_path = audit  # type: ignore[attr-defined]
        http.flush_audit = server.flush_audit  # type: ignore[attr-defined]
        yield http


def _batch(client: httpx.Client, items: list[dict], **fields: object) -> dict:
    response = client.post("/progress/batch", json={"items": items, "include_embeddings": True, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_progress_follows_srpo_against_the_oracle(progress_client, fake_embed):
    items = [item(7, True, (200, 200, 200)), item(7, True, (202, 200, 198)), item(7, True, (198, 201, 200)),
             item(7, False, (180, 190, 200)), item(7, False, (120, 120, 140)), item(7, False, (20, 40, 60))]
    answer = _batch(progress_client, items)
    results = [r["result"] for r in answer["results"]]
    assert all(r["ok"] for r in answer["results"])
    vectors = np.array([r["embedding"]["vector"] for r in results])
    assert vectors[0] == pytest.approx([200 / 255] * 3 + [1.0], abs=0.01)  # the fake embeds the colour sent
    oracle = siirl_rewards(vectors, np.array([i["metadata"]["env_success"] for i in items]), ["7"] * 6)
    assert [r["outcome"] for r in results] == ["success"] * 3 + ["progress"] * 3
    assert [r["progress"] for r in results[:3]] == [1.0, 1.0, 1.0]
    labels = set(DBSCAN(eps=0.5, min_samples=2).fit(StandardScaler().fit_transform(vectors[:3])).labels_) - {-1}
    for k in (3, 4, 5):
        assert 0.6 * results[k]["progress"] == pytest.approx(oracle[k]["score"], abs=1e-9)
        assert results[k]["distance"] == pytest.approx(oracle[k]["distance"], abs=1e-9)
        assert results[k]["reference"] == {"batch_successes": 3, "stored": 0, "centres": max(len(labels), 1),
                                           "clustered": bool(labels), "failures": 3}
    assert results[3]["progress"] > results[4]["progress"] > results[5]["progress"]  # nearer is further along
    assert answer["summary"] == {"ok": 6, "failed": 0, "success": 3, "progress": 3, "no_reference": 0, "tasks": 1}
    assert answer["method"]["name"] == "srpo" and answer["method"]["dbscan_eps"] == 0.5
    assert len(fake_embed.embedding_requests) == 6 and fake_embed.chat_requests == []


def test_vllm_receives_one_video_conversation_per_episode(progress_client, fake_embed):
    _batch(progress_client, [item("a", True, (10, 20, 30))], include_embeddings=False)
    (body,) = fake_embed.embedding_requests
    assert body["model"] == EMBED_MODEL and body["encoding_format"] == "float"
    (message,) = body["messages"]
    assert message["role"] == "user" and [p["type"] for p in message["content"]] == ["video_url"]
    assert message["content"][0]["video_url"]["url"].startswith("data:video/jpeg;base64,")
    assert len(message["content"][0]["video_url"]["url"].split(",")) == 4 + 1  # 4 frames
    assert body["media_io_kwargs"] == {"video": {"num_frames": 4, "fps": 4.0}}


def test_a_task_without_successes_gets_no_reference_never_a_number(progress_client, tmp_path):
    answer = _batch(progress_client, [item(1, True, (200, 0, 0)), item(1, False, (100, 0, 0)),
                                      item(2, False, (0, 200, 0)), item(2, False, (0, 100, 0))])
    results = [r["result"] for r in answer["results"]]
    assert [r["outcome"] for r in results] == ["success", "progress", "no_reference", "no_reference"]
    assert results[1]["progress"] == 0.5  # one failure: SRPO's normalisation has nothing to spread
    assert results[2]["progress"] is None and results[2]["reference"] is None
    assert answer["summary"]["no_reference"] == 2 and answer["summary"]["tasks"] == 2
    progress_client.flush_audit()
    lines = [json.loads(line) for line in progress_client.audit_path.read_text().splitlines()]
    assert [line["outcome"] for line in lines if line.get("kind") == "progress"] == [
        "success", "progress", "no_reference", "no_reference"]
    assert all(line["metadata"]["task_id"] in (1, 2) and line["endpoint"] for line in lines)


def test_one_episode_alone(progress_client):
    assert _batch(progress_client, [item(3, False, (9, 9, 9))])["results"][0]["result"]["outcome"] == "no_reference"
    assert _batch(progress_client, [item(3, True, (9, 9, 9))])["results"][0]["result"]["progress"] == 1.0


@pytest.mark.parametrize(("index", "key"), [(1, "task_id"), (0, "env_success")])
def test_an_item_without_task_or_success_fails_the_request_before_anything_is_sent(progress_client, fake_embed,
                                                                                   index, key):
    items = [item(1, True, (1, 1, 1)), item(1, False, (2, 2, 2))]
    del items[index]["metadata"][key]
    response = progress_client.post("/progress/batch", json={"items": items})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == f"items[{index}].metadata.{key}"
    assert fake_embed.embedding_requests == []


@pytest.mark.parametrize(("body", "field"), [
    ({"backend": "qwen2_5_vl_vllm"}, "backend"),
    ({"items": [{**item(1, True, (1, 1, 1)), "backend_kwargs": {"temperature": 0.5}}]}, "items[0].backend_kwargs"),
    ({"items": [{**item(1, True, (1, 1, 1)), "nframes": 100000}]}, "items[0].nframes"),
    ({"items": []}, "items"),
    ({"items": [item("1" * 300, True, (1, 1, 1))]}, "items.0.metadata.task_id"),  # not read as an int
    ({"items": [{**item(1, True, (1, 1, 1)), "backend": "qwen2_5_vl_vllm"}]}, "items[0].backend"),
    ({"items": [item(1, True, (1, 1, 1)), {**item(1, False, (2, 2, 2)), "max_pixels": 28 * 28 * 64}]}, "items[1]"),
    ({"items": [item(1, True, (1, 1, 1)), {**item(1, False, (2, 2, 2)), "video_fps": 8}]}, "items[1]"),
    # a second camera on a one-camera backend: the whole request, as the other per-item rules (the fuzzer's find)
    ({"items": [item(1, True, (1, 1, 1)), {**item(1, False, (2, 2, 2)),
                                          "extra_view": {"frames_npy": item(1, False, (3, 3, 3))["frames_npy"]}}]},
     "items[1].extra_view"),
])
def test_bad_requests_name_the_field(progress_client, fake_embed, body, field):
    response = progress_client.post("/progress/batch", json={"items": [item(1, True, (1, 1, 1))], **body})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field
    assert fake_embed.embedding_requests == []


def test_a_chat_route_refuses_the_embedding_backend(progress_client):
    response = progress_client.post("/score", json={"backend": "embed", **item(1, True, (1, 1, 1))})
    assert response.status_code == 422 and "POST /progress/batch" in response.json()["error"]["message"]


def test_a_failed_embedding_fails_its_whole_task_and_no_other(progress_client, fake_embed):
    fake_embed.script({"status": 400, "message": "bad video"})  # not retryable: whichever call gets it
    answer = progress_client.post("/progress/batch", json={"items": [
        item("a", True, (200, 0, 0)), item("a", False, (100, 0, 0)),
        item("b", True, (0, 200, 0)), item("b", False, (0, 100, 0))]}).json()
    rejected = [r for r in answer["results"] if not r["ok"] and r["error"]["code"] == "upstream_rejected"]
    assert len(rejected) == 1
    broken = rejected[0]["index"]
    mate = {0: 1, 1: 0, 2: 3, 3: 2}[broken]
    others = sorted({0, 1, 2, 3} - {broken, mate})
    group = answer["results"][mate]
    assert not group["ok"] and group["status"] == 502 and group["error"]["code"] == "progress_group_failed"
    assert group["error"]["failed_index"] == broken
    assert all(answer["results"][i]["ok"] for i in others)
    assert answer["summary"]["failed"] == 2 and answer["summary"]["ok"] == 2


@pytest.mark.parametrize("reply", [
    {"body": {"data": [{"embedding": [0.0, 0.0, 0.0]}]}},  # all zeros: siiRL's broken V-JEPA vector
    {"body": {"data": [{"embedding": [1.0, "x"]}]}},
    {"malformed": True},
    {"status": 503},
])
def test_a_broken_embedding_reply_is_retried_never_measured(progress_client, fake_embed, reply):
    fake_embed.script(reply)
    answer = _batch(progress_client, [item("a", True, (50, 50, 50))])
    result = answer["results"][0]["result"]
    assert result["embedding"]["attempts"] == 2 and result["embedding"]["dim"] == 4


def test_a_persistently_broken_embedding_is_an_item_error_never_a_number(progress_client, fake_embed):
    fake_embed.script(*[{"body": {"data": [{"embedding": [0.0, 0.0]}]}}] * 3)  # every attempt (retry.attempts 3)
    answer = progress_client.post("/progress/batch", json={"items": [item("a", False, (5, 5, 5))]}).json()
    (only,) = answer["results"]
    assert not only["ok"] and only["status"] == 502 and only["error"]["code"] == "upstream_bad_response"
    assert "result" not in only and answer["summary"]["failed"] == 1


def test_a_bad_frame_fails_its_task_with_the_causes_status(progress_client):
    broken = {**item("a", False, (5, 5, 5)), "frames_npy": "k05VTVBZAQB2AHsn"}  # a truncated .npy
    answer = progress_client.post("/progress/batch", json={"items": [item("a", True, (1, 1, 1)), broken]}).json()
    first, second = answer["results"]
    assert second["status"] == 422 and second["error"]["code"] == "media_decode_error"
    assert first["status"] == 422 and first["error"]["code"] == "progress_group_failed"
    assert first["error"]["cause"] == "media_decode_error" and not first["error"]["retryable"]


def _store_settings(fake_qwen, fake_primo, fake_embed, media_root, tmp_path, monkeypatch, **store):
    monkeypatch.setenv("PROGRESS_TEST_KEY", "k")  # the admin key (it may also score)
    return _settings(fake_qwen, fake_primo, fake_embed, media_root, admin_api_key_env="PROGRESS_TEST_KEY",
                     reference_store={"dir": str(tmp_path / "refs"), **store})


def _authed(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=30, trust_env=False, headers={"authorization": "Bearer k"})


def test_adding_demonstrations_needs_the_admin_key(progress_client):
    response = progress_client.post("/progress/references", json={"task_id": 1, "items": [item(None, None, (1, 2, 3))]})
    assert response.status_code == 403 and response.json()["error"]["code"] == "admin_disabled"


def test_the_reference_store_keeps_successes_and_demonstrations_across_restarts(
        proxy_factory, fake_qwen, fake_primo, fake_embed, media_root, tmp_path, monkeypatch):
    settings = _store_settings(fake_qwen, fake_primo, fake_embed, media_root, tmp_path, monkeypatch,
                               max_successes=2, max_demonstrations=1)
    first = proxy_factory(settings)
    with _authed(first) as http:
        _batch(http, [item(5, True, (10, 10, 10)), item(5, True, (12, 12, 12)), item(5, True, (200, 200, 200))])
        added = http.post("/progress/references", json={"task_id": "demo-task", "items": [item(None, None, (1, 2, 3))]})
        assert added.status_code == 200, added.text
        assert added.json()["demonstrations"] == 1 and added.json()["model"] == EMBED_MODEL
        again = http.post("/progress/references", json={"task_id": "demo-task", "items": [item(None, None, (1, 2, 3))]})
        assert again.json()["added"] == 0 and again.json()["demonstrations"] == 1  # a repeat is not a second one
        full = http.post("/progress/references", json={"task_id": "demo-task", "items": [item(None, None, (3, 2, 1))]})
        assert full.status_code == 409 and full.json()["error"]["code"] == "reference_store_full"
    first.stop()
    (tmp_path / "refs" / "junk.npz").write_bytes(b"not a zip")  # ignored, as is a crash's leftover
    second = proxy_factory(settings)
    with _authed(second) as http:
        held = {t["task_id"]: t for t in http.get("/progress/references").json()["store"]["tasks"]}
        assert held["5"]["successes"] == 2 and held["demo-task"]["demonstrations"] == 1
        # No success in this batch: the stored ones (the newest two: 12 and 200) are the references.
        answer = _batch(http, [item(5, False, (12, 12, 12)), item(5, False, (90, 90, 90))])
        results = [r["result"] for r in answer["results"]]
        assert [r["outcome"] for r in results] == ["progress", "progress"]
        assert results[0]["reference"]["stored"] == 2 and results[0]["reference"]["batch_successes"] == 0
        alone = _batch(http, [item(5, False, (1, 1, 1))], use_reference_store=False)
        assert alone["results"][0]["result"]["outcome"] == "no_reference"


def test_metrics_count_progress_outcomes(progress_client):
    _batch(progress_client, [item(1, True, (200, 0, 0)), item(1, False, (100, 0, 0)), item(2, False, (1, 1, 1))])
    text = progress_client.get("/metrics").text
    assert 'vlm_proxy_progress_episodes_total{backend="embed",outcome="success"} 1.0' in text
    assert 'vlm_proxy_progress_episodes_total{backend="embed",outcome="no_reference"} 1.0' in text
    assert 'vlm_proxy_progress_count{backend="embed"} 1.0' in text


def test_references_are_kept_apart_by_namespace_and_not_remembered_when_asked_not_to(
        proxy_factory, fake_qwen, fake_primo, fake_embed, media_root, tmp_path, monkeypatch):
    server = proxy_factory(_store_settings(fake_qwen, fake_primo, fake_embed, media_root, tmp_path, monkeypatch))
    with _authed(server) as http:
        _batch(http, [item(1, True, (10, 10, 10))], reference_namespace="run-1")
        _batch(http, [item(2, True, (10, 10, 10))], remember_successes=False)
        held = {(t["namespace"], t["task_id"]) for t in http.get("/progress/references").json()["store"]["tasks"]}
        assert held == {("run-1", "1")}
        other = _batch(http, [item(1, False, (9, 9, 9))], reference_namespace="run-2")
        same = _batch(http, [item(1, False, (9, 9, 9))], reference_namespace="run-1")
        assert other["results"][0]["result"]["outcome"] == "no_reference"
        assert same["results"][0]["result"]["reference"]["stored"] == 1
        # each answer names the namespace it used and what each task held before it
        assert other["references"] == {"namespace": "run-2", "store": True, "at_start": {"1": 0}, "total_at_start": 0}
        assert same["references"] == {"namespace": "run-1", "store": True, "at_start": {"1": 1}, "total_at_start": 1}
        unnamed = _batch(http, [item(2, True, (10, 10, 10))], use_reference_store=False)
        assert unnamed["references"] == {"namespace": "", "store": False, "at_start": {"2": 0}, "total_at_start": 0}


def test_stored_vectors_of_another_size_are_a_mismatch_not_a_distance(
        proxy_factory, fake_qwen, fake_primo, fake_embed, media_root, tmp_path, monkeypatch):
    server = proxy_factory(_store_settings(fake_qwen, fake_primo, fake_embed, media_root, tmp_path, monkeypatch))
    with _authed(server) as http:
        _batch(http, [item(1, True, (10, 10, 10))])
        fake_embed.script({"embedding": [0.1, 0.2, 0.3, 0.4, 0.5]})  # the checkpoint changed under its name
        (only,) = http.post("/progress/batch", json={"items": [item(1, False, (9, 9, 9))]}).json()["results"]
        assert only["status"] == 409 and only["error"]["code"] == "reference_mismatch"


def test_adding_demonstrations_without_a_store_is_refused(proxy_factory, fake_qwen, fake_primo, fake_embed,
                                                          media_root, monkeypatch):
    monkeypatch.setenv("PROGRESS_TEST_KEY", "k")
    server = proxy_factory(_settings(fake_qwen, fake_primo, fake_embed, media_root,
                                     admin_api_key_env="PROGRESS_TEST_KEY"))
    with _authed(server) as http:
        response = http.post("/progress/references", json={"task_id": 1, "items": [item(None, None, (1, 2, 3))]})
        assert response.status_code == 422 and "reference_store" in response.json()["error"]["message"]
