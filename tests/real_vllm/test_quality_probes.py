"""Invariance probes on the real server (issue 26): a second proxy in this process, in front of the
stack's own Qwen replicas, with every episode probed (reversed and shuffled frames). The probes
run, are marked as probes (never episodes), cost the same prompt tokens as their episode (the same
frames in another order), and the answers' latency with probes on is printed next to the same
episodes with probes off (a measurement, not an assertion: this is a shared 2-core machine)."""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest
import yaml

from proxy.config import settings_from_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.fakes.proxy_server import ProxyServerThread
from tests.helpers import wait_until
from tests.real_vllm.stack import QWEN_ONE_ASK, TASK, RealStack, say

pytestmark = pytest.mark.real_vllm
EPISODES = 6


def _proxy(real_stack: RealStack, audit, probes: bool) -> ProxyServerThread:
    data = yaml.safe_load(real_stack.config_path.read_text())
    data["proxy"]["audit_log"] = str(audit)
    data["quality"] = {"window": 8, "alarm": {"min_episodes": 4},
                       "probes": {"fraction": 1.0 if probes else 0.0, "kinds": ["reversed", "shuffled"],
                                  "max_in_flight": 64, "reserve_slots": 0}}  # every probe runs
    return ProxyServerThread(settings_from_dict(data)).start()


def _score_all(proxy: ProxyServerThread) -> tuple[list[dict], list[float]]:
    answers, seconds = [], []
    with httpx.Client(base_url=proxy.url, timeout=300, trust_env=False) as http:
        for i in range(EPISODES):
            began = time.perf_counter()
            answer = http.post("/score", json={
                "task_text": TASK, "backend": QWEN_ONE_ASK, "frames_npy": npy_b64(episode_frames(8 + i, 224, 224)),
                "metadata": {"run": "probes", "task_id": 1, "env_success": i % 2 == 0, "episode_id": i}})
            seconds.append(time.perf_counter() - began)
            assert answer.status_code == 200, answer.text
            answers.append(answer.json())
    return answers, seconds


def test_probes_run_are_marked_and_cost_their_episodes_tokens(real_stack: RealStack, tmp_path) -> None:
    off = _proxy(real_stack, tmp_path / "off.jsonl", probes=False)
    try:
        _, seconds_off = _score_all(off)
    finally:
        off.stop()
    on = _proxy(real_stack, tmp_path / "on.jsonl", probes=True)
    try:
        answers, seconds_on = _score_all(on)
        with httpx.Client(base_url=on.url, timeout=60, trust_env=False) as http:
            def all_probed():
                entry = http.get("/quality").json()["keys"][0]
                done = entry["probes"]
                return entry if all(done.get(k, {}).get("n") == EPISODES for k in ("reversed", "shuffled")) else None

            entry = wait_until(all_probed, 300, "every episode's two probes on the real server")
        on.flush_audit()
    finally:
        on.stop()
    assert entry["window"]["episodes"] == EPISODES  # probes never enter the agreement window
    lines = [json.loads(line) for line in (tmp_path / "on.jsonl").read_text().splitlines()]
    episodes = {line["metadata"]["episode_id"]: line for line in lines if "kind" not in line}
    probes = [line for line in lines if line.get("kind") == "probe"]
    assert len(episodes) == EPISODES and len(probes) == 2 * EPISODES
    for probe in probes:
        episode = episodes[probe["episode_id"]]
        assert probe["original_score"] == episode["score"] and probe["margin"] == pytest.approx(
            episode["score"] - probe["probe_score"])
        # the same frames in another order: the same vision and prompt tokens
        assert probe["usage"]["prompt_tokens"] == episode["usage"]["prompt_tokens"]
        assert sorted(probe["frames"]["sha256"]) == sorted(episode["frames"]["sha256"])
        assert probe["frames"]["sha256"] != episode["frames"]["sha256"]
    assert [a["quality"]["key"]["task_id"] for a in answers] == ["1"] * EPISODES
    with_probes, without = statistics.median(seconds_on), statistics.median(seconds_off)
    say(f"probes on the real server: answer median {with_probes * 1e3:.0f} ms with probes, {without * 1e3:.0f} ms "
        f"without (x{with_probes / without:.2f}); mean margins "
        f"{({k: round(v['mean_margin'], 3) for k, v in entry['probes'].items()})}")
