"""The frame store keeps the exact JPEGs vLLM received, once each, and never costs a score."""

from __future__ import annotations

import base64
import hashlib
import json
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.fakes.fake_vllm import decode_video_part
from tests.helpers import HANG_S, wait_until
from vlm_protocol.frame_store import frame_path

EPISODE = {"task_text": "put the bowl on the plate", "frames_npy": npy_b64(episode_frames(24, 64, 64)),
           "metadata": {"env_success": True, "task_id": 3, "episode_id": "e1"}}


class StoreProxy:
    """The proxy with an audit log and a frame store under tmp_path, and what it reports."""

    def __init__(self, server, tmp_path) -> None:
        self.store = tmp_path / "frames"
        self.audit_path = tmp_path / "audit.jsonl"
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=30, trust_env=False)

    def score(self, backend: str = "qwen2_5_vl_vllm") -> dict:
        response = self.http.post("/score", json={**EPISODE, "backend": backend})
        assert response.status_code == 200, response.text  # whatever the store did
        return response.json()

    def audit(self) -> list[dict]:
        self.server.flush_audit()
        return [json.loads(line) for line in self.audit_path.read_text().splitlines()]

    def health(self) -> dict:
        return self.http.get("/health").json()

    def errors(self, reason: str) -> float:
        return next((s.value for f in text_string_to_metric_families(self.http.get("/metrics").text)
                     for s in f.samples if s.name == "vlm_proxy_frame_store_errors_total"
                     and s.labels == {"reason": reason}), 0.0)


@pytest.fixture
def store_proxy(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    clients = []

    def make(max_mb: float = 64.0) -> StoreProxy:
        data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                    audit_log=str(tmp_path / "audit.jsonl"),
                                    frame_store={"dir": str(tmp_path / "frames"), "max_mb": max_mb})
        clients.append(StoreProxy(proxy_factory(settings_from_dict(data)), tmp_path))
        return clients[-1]

    yield make
    for client in clients:
        client.http.close()


def _sent_jpegs(request: dict) -> dict[str, bytes]:
    """Every image and video frame of one chat request as vLLM received it, by sha256."""
    jpegs = []
    for part in request["messages"][-1]["content"]:
        if part["type"] == "video_url":
            jpegs += decode_video_part(part["video_url"]["url"], -1)
        elif part["type"] == "image_url":
            jpegs.append(base64.b64decode(part["image_url"]["url"].partition(";base64,")[2]))
    return {hashlib.sha256(j).hexdigest(): j for j in jpegs}


@pytest.mark.parametrize("backend", ["qwen2_5_vl_vllm", "PRIMO-R1"])
def test_the_store_holds_the_bytes_vllm_received_once_each(store_proxy, fake_qwen, fake_primo, backend):
    proxy = store_proxy()
    first, second = proxy.score(backend), proxy.score(backend)
    hashes = first["frames"]["sha256"] + first["frames"]["still_sha256"]
    fake = fake_qwen if backend == "qwen2_5_vl_vllm" else fake_primo
    sent = _sent_jpegs(fake.chat_requests[0])
    assert set(sent) == set(hashes) and len(hashes) == 16 + (2 if backend == "PRIMO-R1" else 0)
    for digest in hashes:
        assert frame_path(proxy.store, digest).read_bytes() == sent[digest]
    unique = len(set(hashes))
    audit = proxy.audit()
    assert [line["frame_store"] for line in audit] == [
        {"written": unique, "present": len(hashes) - unique, "error": None},
        {"written": 0, "present": len(hashes), "error": None}]
    assert second["frames"]["sha256"] == first["frames"]["sha256"]
    assert audit[0]["metadata"] == EPISODE["metadata"]
    assert audit[0]["frames"]["still_sha256"] == first["frames"]["still_sha256"]
    status = proxy.health()["frame_store"]
    assert status["used_mb"] == round(sum(len(sent[d]) for d in set(hashes)) / 2**20, 3)
    assert status["last_error"] is None


def test_a_full_store_still_scores_and_says_so(store_proxy):
    proxy = store_proxy(max_mb=0.001)  # 1 KiB: not one frame fits
    assert [proxy.score()["score"] for _ in range(2)] == [0.75, 0.75]
    for line in proxy.audit():
        assert line["score"] == 0.75 and line["frame_store"]["written"] == 0
        assert "full" in line["frame_store"]["error"] and "proxy.frame_store.max_mb" in line["frame_store"]["error"]
    assert "full" in proxy.health()["frame_store"]["last_error"]
    assert proxy.errors("full") == 2
    assert not [p for p in proxy.store.rglob("*") if p.is_file()]


def test_a_failing_disk_still_scores_and_the_store_recovers(store_proxy):
    """A shard directory that cannot be created (a file stands in its place) is an OS error."""
    proxy = store_proxy()
    hashes = proxy.score()["frames"]["sha256"]
    shards = {digest[:2] for digest in hashes}
    for shard in shards:  # forget what was stored, and block every shard the episode needs
        for path in (proxy.store / shard).iterdir():
            path.unlink()
        (proxy.store / shard).rmdir()
        (proxy.store / shard).write_bytes(b"a file where a directory should be")
    blocked = proxy.score()
    assert blocked["score"] == 0.75
    error = proxy.audit()[-1]["frame_store"]["error"]
    assert error.startswith(("FileExistsError", "NotADirectoryError")) and proxy.errors("os_error") == 1
    assert proxy.health()["frame_store"]["last_error"] == error
    for shard in shards:
        (proxy.store / shard).unlink()
    proxy.score()
    assert proxy.audit()[-1]["frame_store"] == {"written": len(set(hashes)), "present": len(hashes) - len(set(hashes)),
                                                "error": None}
    assert proxy.health()["frame_store"]["last_error"] is None
    assert all(frame_path(proxy.store, d).is_file() for d in hashes)


def test_a_hung_disk_never_holds_up_a_score(store_proxy, monkeypatch, tmp_path):
    # the store's thread blocks until the test lets it go, as a hung NFS mount would
    from proxy.media import frame_store

    released = threading.Event()
    real_put_all = frame_store.FrameStore._put_all

    def hung(self, jpegs, hashes):
        released.wait(60)  # bounded: the test releases it below
        return real_put_all(self, jpegs, hashes)

    monkeypatch.setattr(frame_store.FrameStore, "_put_all", hung)
    monkeypatch.setattr(frame_store, "WAIT_S", 0.05)
    monkeypatch.setattr(frame_store, "MAX_BACKLOG", 2)
    proxy = store_proxy()
    try:
        results = [proxy.score() for _ in range(3)]  # scored, all three, the disk still hung
        assert all(r["score"] == 0.75 for r in results)
        errors = [line["frame_store"]["error"] for line in proxy.audit()]
        assert "longer than" in errors[0] and "longer than" in errors[1]
        assert "waiting for the disk" in errors[2]  # the backlog is bounded: no frames pile up in memory
        assert proxy.errors("slow") == 2 and proxy.errors("backlog") == 1
        assert proxy.health()["frame_store"]["backlog"] == 2
    finally:
        released.set()
    # once the disk answers, what was queued is written after all
    hashes = results[0]["frames"]["sha256"]
    assert wait_until(lambda: all(frame_path(tmp_path / "frames", h).is_file() for h in hashes), HANG_S,
                      "the queued frames to be written")


def test_the_health_entry_shows_no_directory(store_proxy):
    proxy = store_proxy()
    proxy.score()
    assert set(proxy.health()["frame_store"]) == {"used_mb", "max_mb", "last_error", "backlog"}
