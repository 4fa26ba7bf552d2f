"""A restart keeps the reward-quality monitor (issue 39, item 1).

The proxy runs as a real process here because the test stops it the way an operator or a
supervisor does (SIGTERM, the app's lifespan writing its last lines) and starts a new process on
the same audit log: nothing of the first process's memory may survive but the log. The grader is
an in-process fake vLLM that agrees with the simulator's success, except that it calls every
failure of the hacked task a success.
"""

from __future__ import annotations

import json
import signal

import httpx
import numpy as np

from rlinf_client.hook import LiberoVLMReward
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import episode_frames, npy_b64
from tests.helpers import HANG_S, QWEN_MODEL

QWEN = "qwen2_5_vl_vllm"
WINDOW, MIN_EPISODES = 32, 16
HACKED_TASK, FINE_TASK = 2, 1
FRAMES = npy_b64(episode_frames(4, 56, 56))
COMPARED = ("n", "auc", "false_success_rate", "accuracy", "successes", "failures")


def grade(body: dict) -> str:
    text = json.dumps(body["messages"])
    success = "ended: success" in text
    return "<score>90</score>" if success or f"task {HACKED_TASK} " in text else "<score>10</score>"


def episodes(task: int, count: int) -> list[dict]:
    return [{"task_text": f"task {task} ended: {'success' if i % 2 == 0 else 'failure'} #{i}", "backend": QWEN,
             "frames_npy": FRAMES, "metadata": {"run": "runB", "task_id": task, "env_success": i % 2 == 0,
                                                 "episode_id": f"{task}-{i}"}}
            for i in range(count)]


def quality(url: str) -> dict:
    with httpx.Client(timeout=HANG_S, trust_env=False) as http:
        response = http.get(f"{url}/quality")
    assert response.status_code == 200, response.text
    return response.json()


def by_task(body: dict) -> dict[str, dict]:
    return {entry["key"]["task_id"]: entry for entry in body["keys"]}


def native_hook(url: str) -> LiberoVLMReward:
    """The RLinf hook as run B configures it, paying the simulator's reward while a key is in alarm."""
    return LiberoVLMReward({"enable": True, "endpoint": f"{url}/score", "backend": QWEN, "run": "runB",
                            "on_quality_alarm": "native", "fallback": "raise", "nframes": 4, "buffer_frames": 8,
                            "timeout": HANG_S}, 1, reward_coef=1.0, use_rel_reward=False, ignore_terminations=False)


def one_failed_episode(hook: LiberoVLMReward, task: int) -> tuple[float, dict]:
    """An episode of `task` that fails at truncation; its reward at the end step and the hook's info."""
    frames = np.zeros((1, 56, 56, 3), np.uint8)
    hook.on_reset({"main_images": frames})
    reward = hook.step_reward({"main_images": frames}, [False], [True], [f"task {task} ended: failure #x"],
                              task_ids=[task])
    return float(reward[0]), hook.episode_info()


def test_a_restart_on_the_same_audit_log_keeps_the_windows_and_the_open_alarm(fake_vllm_factory, fake_primo,
                                                                              proxy_proc, media_root, tmp_path):
    qwen = fake_vllm_factory(served_model_name=QWEN_MODEL, record=False)
    qwen.fake.state.reply_fn = grade
    audit = tmp_path / "audit.jsonl"
    data = libero_settings_dict([qwen.base_url], [fake_primo.base_url], media_root, audit_log=str(audit),
                                audit={"max_mb": 0.01, "keep": 100})  # rotated: the rebuild reads every file
    data["quality"] = {"window": WINDOW, "alarm": {"min_episodes": MIN_EPISODES}}
    proxy = proxy_proc(data)
    with httpx.Client(base_url=proxy.url, timeout=HANG_S, trust_env=False) as http:
        for item in episodes(FINE_TASK, WINDOW + 8) + episodes(HACKED_TASK, WINDOW + 8):
            assert http.post("/score", json=item).status_code == 200
    before = by_task(quality(proxy.url))
    assert before[str(HACKED_TASK)]["status"] == "alarm" and before[str(FINE_TASK)]["status"] == "ok"

    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(HANG_S) in (0, -signal.SIGTERM)
    assert len(list(tmp_path.glob("audit.jsonl.*"))) > 1  # the log spans rotated files
    lines = [json.loads(line) for part in sorted(tmp_path.glob("audit.jsonl*"))
             for line in part.read_text().splitlines()]
    assert [line["status"] for line in lines if line.get("kind") == "quality_alarm"].count("reset") == 1

    proxy.start()  # a new process, same config, same audit log
    after = quality(proxy.url)
    assert after["restore"]["restored"] is True and after["restore"]["stopped_by"] == "start_of_log"
    assert str(audit) in after["restore"]["files"] and after["restore"]["alarms"] == 1
    restored = by_task(after)
    assert set(restored) == set(before)
    for task, entry in before.items():
        assert {k: restored[task]["window"][k] for k in COMPARED} == {k: entry["window"][k] for k in COMPARED}
        assert restored[task]["first_window"] == entry["first_window"]
        assert restored[task]["episodes_seen"] == entry["episodes_seen"]
        assert restored[task]["restored_from"]["episodes"] == WINDOW + 8
    assert restored[str(HACKED_TASK)]["status"] == "alarm"  # still open: only the numbers clear it
    assert restored[str(HACKED_TASK)]["reason"] == before[str(HACKED_TASK)]["reason"]
    assert restored[str(FINE_TASK)]["status"] == "ok"
    assert after["status"] == "alarm"

    # The first episode after the restart: the alarmed key pays the native reward (a failure: 0),
    # where the VLM called it a success; the key that is fine pays the VLM's score.
    hook = native_hook(proxy.url)
    try:
        reward, info = one_failed_episode(hook, HACKED_TASK)
        assert (reward, info["vlm_quality_alarm"][0], info["vlm_fallback"][0]) == (0.0, 1.0, 1.0)
        assert info["vlm_score"][0] == 0.0  # the native value, not the VLM's 0.9
        reward, info = one_failed_episode(hook, FINE_TASK)
        assert (reward, info["vlm_quality_alarm"][0], info["vlm_fallback"][0]) == (0.0, 0.0, 0.0)
        assert info["vlm_score"][0] == 0.1
    finally:
        hook.close()

    # A proxy on a new log starts empty.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    proxy.proc.send_signal(signal.SIGTERM)
    proxy.proc.wait(HANG_S)
    new = proxy_proc({**data, "proxy": {**data["proxy"], "audit_log": str(fresh / "audit.jsonl")}})
    empty = quality(new.url)
    assert empty["keys"] == [] and empty["restore"]["keys"] == 0 and empty["restore"]["files"] == []
