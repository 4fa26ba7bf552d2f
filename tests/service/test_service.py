"""Health, metrics, audit log and hot-reloaded prompts on the running service."""

import json
import os
import shutil
from pathlib import Path

import httpx

from proxy.config import settings_from_dict
from tests.conftest import PROMPTS_DIR, libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import HANG_S, wait_until

EPISODE = {"task_text": "t", "frames_npy": npy_b64(episode_frames(6, 64, 64))}


def test_health_reports_each_backend_and_notices_a_dead_one(client, fake_primo):
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert set(health.json()["backends"]) == {"qwen2_5_vl_vllm", "PRIMO-R1"}
    fake_primo.stop()
    health = wait_until(lambda: (h := client.get("/health").json())["status"] == "degraded" and h, HANG_S,
                        "the probe to notice the dead backend")
    primo = health["backends"]["PRIMO-R1"]
    assert primo["ready"] is False and primo["endpoints"][0]["reason"]


def test_health_answers_from_the_probes_cache_without_calling_upstream(client, fake_qwen):
    before = fake_qwen.fake.state.readiness_gets
    for _ in range(50):
        assert client.get("/health").status_code == 200
    probed_meanwhile = fake_qwen.fake.state.readiness_gets - before
    assert probed_meanwhile < 50 * 2  # the old /health made 2 upstream GETs per endpoint per call


def test_health_notices_a_wrong_model(proxy_factory, fake_vllm_factory, fake_primo, media_root):
    other = fake_vllm_factory(served_model_name="something-else")
    settings = settings_from_dict(libero_settings_dict([other.base_url], [fake_primo.base_url], media_root))
    server = proxy_factory(settings)
    with httpx.Client(base_url=server.url) as http:
        qwen = http.get("/health").json()["backends"]["qwen2_5_vl_vllm"]
    assert qwen["ready"] is False and "not served" in qwen["endpoints"][0]["reason"]


def test_metrics_count_outcomes_and_parse_failures(client, fake_qwen):
    fake_qwen.script({"reply": "hmm"})
    assert client.post("/score", json=EPISODE).status_code == 200
    client.post("/score", json={**EPISODE, "backend": "nope"})
    client.post("/score", json={"task_text": "t"})  # schema 422: no frame source
    client.post("/score", content=b"{not json", headers={"content-type": "application/json"})
    client.get("/nowhere")
    text = client.get("/metrics").text
    assert 'vlm_proxy_requests_total{backend="qwen2_5_vl_vllm",outcome="ok",route="/score"} 1.0' in text
    assert 'vlm_proxy_requests_total{backend="none",outcome="unknown_backend",route="/score"} 1.0' in text
    assert 'vlm_proxy_requests_total{backend="none",outcome="invalid_request",route="/score"} 2.0' in text
    assert 'vlm_proxy_requests_total{backend="none",outcome="not_found",route="unmatched"} 1.0' in text
    assert 'vlm_proxy_parse_failures_total{backend="qwen2_5_vl_vllm"} 1.0' in text
    assert 'vlm_proxy_replies_total{backend="qwen2_5_vl_vllm",finish_reason="stop"} 2.0' in text
    assert "vlm_proxy_score_bucket" in text


def test_audit_log_has_provenance_and_no_media(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    audit = tmp_path / "audit.jsonl"
    server = proxy_factory(settings_from_dict(
        libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, audit_log=str(audit))))
    fake_qwen.script({"status": 500}, {"status": 500}, {"status": 500}, {"status": 500})
    with httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/score", json=EPISODE)
        http.post("/score", json=EPISODE)
    fake_qwen.script({"reply": "maybe 40"}, {"reply": "still 40-ish"})
    with httpx.Client(base_url=server.url, timeout=30) as http:
        http.post("/score", json=EPISODE)
    server.flush_audit()
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    assert [("error" in line) for line in lines] == [True, False, True]
    assert lines[0]["error"]["code"] == "upstream_unavailable" and lines[0]["attempts"] == 4
    ok, unparseable = lines[1], lines[2]
    assert ok["prompt"]["name"] == "qwen_progress" and len(ok["frames"]["sha256"]) == 6
    assert ok["usage"]["prompt_tokens"] > 0 and ok["sampling"]["seed"] == 0
    # a failed episode carries the same provenance, plus the model's last reply
    assert unparseable["error"]["code"] == "unparseable_score" and unparseable["attempts"] == 2
    assert unparseable["frames"]["sha256"] == ok["frames"]["sha256"]
    assert unparseable["prompt"] == ok["prompt"] and unparseable["sampling"]["seed"] == 1
    assert unparseable["output_text"] == "still 40-ish" and unparseable["finish_reason"] == "stop"
    assert "base64" not in audit.read_text() and len(audit.read_text()) < 20_000


def test_prompt_edit_applies_without_restart(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    prompts = tmp_path / "prompts"
    shutil.copytree(PROMPTS_DIR, prompts)
    server = proxy_factory(settings_from_dict(
        libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root, prompts_dir=str(prompts))))
    with httpx.Client(base_url=server.url, timeout=30) as http:
        before = http.post("/score", json=EPISODE).json()["prompt"]["sha256"]
        path: Path = prompts / "qwen_progress.yaml"
        path.write_text("variables: {task_text: {}}\nuser: 'EDITED ${task_text} <score>?</score>'\n"
                        "answer: {tags: [score], scale: {min: 0, max: 100}}\n")
        stamp = path.stat().st_mtime_ns + 2_000_000_000
        os.utime(path, ns=(stamp, stamp))
        # the file is checked off the event loop, so the edit applies once that check has run
        after = wait_until(lambda: (sha := http.post("/score", json=EPISODE).json()["prompt"]["sha256"]) != before
                           and sha, HANG_S, "the edited template to be used")
    assert before != after
    assert fake_qwen.chat_requests[-1]["messages"][-1]["content"][-1]["text"].startswith("EDITED t")


def test_proxy_core_does_not_import_torch_or_qwen_vl_utils():
    import subprocess
    import sys
    code = ("import sys, proxy.http.app, proxy.cli, proxy.media.encode; "
            "bad = [m for m in ('torch', 'torchvision', 'qwen_vl_utils', 'vllm') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
