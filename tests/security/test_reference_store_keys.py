"""Issue 24, item 6: the reference store is bounded in keys. Callers name namespaces and tasks, so
on today's main every new (namespace, task) any caller names adds a file and an entry for good.
With reference_store.max_keys, a new key beyond the cap is refused: POST /progress/references
answers 409 `reference_keys_full`; POST /progress/batch still answers the batch's progress (right
for this batch) and names the task under `not_remembered`, never silently; both are counted in
`vlm_proxy_reference_store_refusals_total`. The keys held keep working."""

from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import npy_b64

EMBED_MODEL, ADMIN = "fake-embed", "adm1n-key"


def _item(task: object, success: bool | None, level: int) -> dict:
    metadata = {"task_id": task} if task is not None else {}
    if success is not None:
        metadata["env_success"] = success
    return {"task_text": f"task {task}", "frames_npy": npy_b64(np.full((4, 28, 28, 3), level, np.uint8)), "fps": 20,
            "metadata": metadata}


@pytest.fixture
def store_proxy(monkeypatch, proxy_factory, fake_vllm_factory, fake_qwen, fake_primo, media_root, tmp_path):
    monkeypatch.setenv("PROXY_ADMIN_KEY", ADMIN)
    embed = fake_vllm_factory(served_model_name=EMBED_MODEL)
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                admin_api_key_env="PROXY_ADMIN_KEY",
                                reference_store={"dir": str(tmp_path / "refs"), "max_keys": 2})
    data["backends"]["embed"] = {"model": EMBED_MODEL, "kind": "embedding", "endpoints": [embed.base_url],
                                 "frames": {"nframes": 4}}
    server = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False,
                      headers={"authorization": f"Bearer {ADMIN}"}) as http:
        yield http


def _refusals(http: httpx.Client, route: str) -> float:
    found = re.search(rf'^vlm_proxy_reference_store_refusals_total{{code="reference_keys_full",route="{route}"}} '
                      r"(\S+)$", http.get("/metrics").text, re.M)
    return float(found.group(1)) if found else 0.0


def test_a_new_key_beyond_max_keys_is_refused_and_the_held_keys_keep_working(store_proxy):
    http = store_proxy
    first = http.post("/progress/batch", json={"items": [_item("a", True, 10), _item("b", True, 20)]})
    assert first.status_code == 200 and first.json()["not_remembered"] == []
    # A third task: its progress is answered (against this batch's success), its success not kept, and said so.
    third = http.post("/progress/batch", json={"items": [_item("c", True, 30), _item("c", False, 90),
                                                         _item("a", True, 40)]}).json()
    assert [r["result"]["outcome"] for r in third["results"]] == ["success", "progress", "success"]
    (lost,) = third["not_remembered"]
    assert (lost["task_id"], lost["successes"], lost["code"]) == ("c", 1, "reference_keys_full")
    assert "max_keys" in lost["message"]
    assert _refusals(http, "/progress/batch") == 1
    held = {t["task_id"]: t for t in http.get("/progress/references").json()["store"]["tasks"]}
    assert set(held) == {"a", "b"} and held["a"]["successes"] == 2  # a known key still grows
    # Demonstrations of a new task: a clear 409; of a held one: added.
    refused = http.post("/progress/references", json={"task_id": "d", "items": [_item(None, None, 50)]})
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"]["code"] == "reference_keys_full" and "max_keys" in refused.json()["error"]["message"]
    assert _refusals(http, "/progress/references") == 1
    added = http.post("/progress/references", json={"task_id": "b", "items": [_item(None, None, 60)]})
    assert added.status_code == 200 and added.json()["demonstrations"] == 1
    # Another namespace is another key: refused as well.
    other = http.post("/progress/batch", json={"items": [_item("a", True, 70)], "reference_namespace": "run-2"})
    assert other.json()["not_remembered"][0]["code"] == "reference_keys_full"
