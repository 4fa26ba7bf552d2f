"""The live reward-quality monitor through the real proxy: a fake grader that agrees with the
simulator's success, then rates one task's failures as successes (a hacked reward), then recovers.
The alarm fires within one window for that task only, /health, /quality, /metrics, the answers and
the audit log say so, and it clears when the grader recovers."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.fakes.episodes import decode_jpeg_b64, episode_frames, frame_level, npy_b64
from tests.helpers import HANG_S, QWEN_MODEL, wait_until

QWEN = "qwen2_5_vl_vllm"
WINDOW, MIN_EPISODES = 32, 16
FRAMES = npy_b64(episode_frames(4, 56, 56))
HACKED = {"task": None}  # the task whose failures the grader now calls successes


def grade(body: dict) -> str:
    """Reads the outcome the test wrote into the task text: 90 for a success, 10 for a failure, 90
    for a failure of the hacked task."""
    text = json.dumps(body["messages"])
    if "(no score)" in text:
        return "I cannot tell from this video."
    success = "ended: success" in text
    hacked = HACKED["task"] is not None and f"task {HACKED['task']} " in text
    return "<score>90</score>" if success or hacked else "<score>10</score>"


@pytest.fixture
def monitored(fake_vllm_factory, fake_primo, proxy_factory, media_root, tmp_path):
    HACKED["task"] = None
    qwen = fake_vllm_factory(served_model_name=QWEN_MODEL, record=False)
    qwen.fake.state.reply_fn = grade
    data = libero_settings_dict([qwen.base_url], [fake_primo.base_url], media_root, audit_log=str(tmp_path / "a.jsonl"))
    data["quality"] = {"window": WINDOW, "alarm": {"min_episodes": MIN_EPISODES}}
    proxy = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
        yield proxy, http, tmp_path / "a.jsonl"


def episodes(task: int, start: int, count: int, run: str = "runB") -> list[dict]:
    """Alternating successes and failures of one task (episode ids from `start`)."""
    return [{"task_text": f"task {task} ended: {'success' if i % 2 == 0 else 'failure'} #{i}", "backend": QWEN,
             "frames_npy": FRAMES, "metadata": {"run": run, "task_id": task, "env_success": i % 2 == 0,
                                                 "episode_id": i}}
            for i in range(start, start + count)]


def score_all(http: httpx.Client, items: list[dict]) -> list[dict]:
    """One /score per episode, in order (the window's order is the episodes' order)."""
    answers = []
    for item in items:
        response = http.post("/score", json=item)
        assert response.status_code == 200, response.text
        answers.append(response.json())
    return answers


def keys(http: httpx.Client) -> dict[str, dict]:
    body = http.get("/quality").json()
    return {entry["key"]["task_id"]: entry for entry in body["keys"]}


def test_the_alarm_fires_for_the_hacked_task_only_and_clears_when_it_recovers(monitored, caplog):
    proxy, http, audit = monitored
    first = score_all(http, episodes(1, 0, MIN_EPISODES - 1) + episodes(2, 0, MIN_EPISODES - 1))
    assert {a["quality"]["status"] for a in first} == {"unknown"}  # not enough episodes yet
    score_all(http, episodes(1, 100, WINDOW) + episodes(2, 100, WINDOW))
    before = keys(http)
    assert before["1"]["status"] == before["2"]["status"] == "ok"
    assert before["1"]["window"]["auc"] == 1.0 and before["1"]["first_window"]["false_success_rate"] == 0.0
    assert http.get("/health").json()["reward_quality"] == {"status": "ok", "alarms": []}

    HACKED["task"] = 1
    with caplog.at_level(logging.WARNING, logger="proxy.quality.monitor"):
        hacked = score_all(http, episodes(1, 200, WINDOW))
        others = score_all(http, episodes(2, 200, WINDOW))
    statuses = [a["quality"]["status"] for a in hacked]
    fired = statuses.index("alarm")
    assert fired < WINDOW and set(statuses[fired:]) == {"alarm"}  # within one window, and it holds
    assert "false-success rate" in hacked[-1]["quality"]["reason"]
    assert hacked[-1]["quality"]["key"] == {"run": "runB", "backend": QWEN, "task_id": "1"}
    assert {a["quality"]["status"] for a in others} == {"ok"}  # the other task is not in alarm
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "ALARM" in caplog.records[0].getMessage() and len(caplog.records) == 1  # one warning per transition

    health = http.get("/health").json()
    assert health["status"] == "ok"  # an alarm never makes the proxy unhealthy
    assert health["reward_quality"]["status"] == "alarm"
    assert [(a["task_id"], a["run"], a["backend"]) for a in health["reward_quality"]["alarms"]] == [("1", "runB", QWEN)]
    now = keys(http)
    assert now["1"]["status"] == "alarm" and now["1"]["window"]["false_success_rate"] > 0.3
    assert now["1"]["first_window"]["false_success_rate"] == 0.0  # the first full window, for comparison
    metrics = http.get("/metrics").text
    assert 'vlm_proxy_quality_alarm{backend="qwen2_5_vl_vllm",run="runB",task="1"} 1.0' in metrics
    assert 'vlm_proxy_quality_alarm{backend="qwen2_5_vl_vllm",run="runB",task="2"} 0.0' in metrics
    assert 'vlm_proxy_quality_alarm_transitions_total{backend="qwen2_5_vl_vllm",to="alarm"} 1.0' in metrics

    HACKED["task"] = None  # the grader recovers: the alarm clears within a window
    recovered = score_all(http, episodes(1, 300, WINDOW))
    assert recovered[-1]["quality"]["status"] == "ok"
    assert http.get("/health").json()["reward_quality"]["status"] == "ok"
    proxy.flush_audit()
    transitions = [json.loads(line) for line in audit.read_text().splitlines() if '"quality_alarm"' in line]
    assert [(t["task_id"], t["status"]) for t in transitions] == [("1", "alarm"), ("1", "ok")]
    assert transitions[0]["numbers"]["false_success_rate"] > 0.3 and transitions[0]["run"] == "runB"


def test_parse_failures_count_in_the_window_and_episodes_without_truth_are_not_tracked(monitored):
    _, http, _ = monitored
    item = episodes(3, 0, 1)[0]
    no_truth = {**item, "metadata": {"run": "runB", "task_id": 3}}
    assert http.post("/score", json=no_truth).json()["quality"] is None  # nothing known of task 3 yet
    score_all(http, [item])
    unparseable = http.post("/score", json={**item, "task_text": "task 3 ended: success (no score)"})
    assert unparseable.json()["error"]["code"] == "unparseable_score"
    answer = http.post("/score", json=no_truth).json()  # no truth: reported on, not added
    assert answer["quality"]["status"] == "unknown" and answer["quality"]["key"]["task_id"] == "3"
    entry = keys(http)["3"]
    assert entry["episodes_seen"] == 2
    assert entry["window"]["episodes"] == 2 and entry["window"]["parse_failures"] == 1 and entry["window"]["n"] == 1


def test_a_new_key_beyond_the_cap_evicts_the_idlest_key_not_in_alarm(fake_vllm_factory, fake_primo, proxy_factory,
                                                                     media_root):
    HACKED["task"] = 1
    qwen = fake_vllm_factory(served_model_name=QWEN_MODEL, record=False)
    qwen.fake.state.reply_fn = grade
    data = libero_settings_dict([qwen.base_url], [fake_primo.base_url], media_root)
    data["quality"] = {"max_keys": 2, "window": 8, "alarm": {"min_episodes": 4, "min_per_outcome": 2}}
    proxy = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
        assert score_all(http, episodes(1, 0, 8))[-1]["quality"]["status"] == "alarm"
        score_all(http, episodes(2, 0, 2))
        score_all(http, episodes(3, 0, 2))  # room for key 3: key 2 goes, never key 1 (in alarm)
        assert sorted(keys(http)) == ["1", "3"]
        metrics = http.get("/metrics").text
        assert "vlm_proxy_quality_keys_evicted_total 1.0" in metrics and 'task="2"' not in metrics
        HACKED["task"] = 3
        assert score_all(http, episodes(3, 2, 6))[-1]["quality"]["status"] == "alarm"
        # every key in alarm: a new key is counted, not tracked, and no alarm is forgotten
        assert score_all(http, episodes(4, 0, 1))[0]["quality"] is None
        assert sorted(keys(http)) == ["1", "3"] and http.get("/quality").json()["keys_dropped_episodes"] == 1
        assert "vlm_proxy_quality_keys_dropped_total 1.0" in http.get("/metrics").text


def test_a_dense_curve_counts_as_its_episode_and_a_replay_never_counts(monitored):
    _, http, _ = monitored
    item = episodes(5, 0, 1)[0]
    dense = http.post("/score/dense", json={**item, "frames_npy": npy_b64(episode_frames(8, 56, 56)), "points": 3})
    assert dense.status_code == 200, dense.text
    assert dense.json()["quality"] == {"status": "unknown", "reason": None,
                                       "key": {"run": "runB", "backend": QWEN, "task_id": "5"}}
    assert keys(http)["5"]["episodes_seen"] == 1  # the curve is one episode, not three
    replayed = {**item, "metadata": {**item["metadata"], "replay_of_line": 12}}
    assert http.post("/score", json=replayed).json()["quality"] is None
    assert keys(http)["5"]["episodes_seen"] == 1


def video_jpegs(body: dict) -> list[str]:
    """The base64 JPEGs of the request's video part (data:video/jpeg;base64,<a>,<b>,...)."""
    for message in body["messages"]:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part.get("type") == "video_url":
                return part["video_url"]["url"].partition(";base64,")[2].split(",")
    raise AssertionError("no video part")


def order_sensitive(body: dict) -> str:
    """A grader that reads time order and the instruction: the frames' mean brightness rises over a
    good episode (episode_frames is a ramp), so a reply of 90 needs the first frame darker than the
    last and the instruction it was trained on; anything else gets 30."""
    text = json.dumps(body["messages"])
    levels = [frame_level(decode_jpeg_b64(jpeg)) for jpeg in video_jpegs(body)]
    rising = levels == sorted(levels) and levels[0] < levels[-1]
    return "<score>90</score>" if rising and "put the bowl" in text else "<score>30</score>"


def test_probes_score_reversed_shuffled_and_other_instructions_in_the_background(
        fake_vllm_factory, fake_primo, proxy_factory, media_root, tmp_path):
    qwen = fake_vllm_factory(served_model_name=QWEN_MODEL)
    qwen.fake.state.reply_fn = order_sensitive
    data = libero_settings_dict([qwen.base_url], [fake_primo.base_url], media_root, audit_log=str(tmp_path / "a.jsonl"))
    data["quality"] = {"window": 8, "alarm": {"min_episodes": 4}, "probes": {"fraction": 1.0, "seed": 7}}
    proxy = proxy_factory(settings_from_dict(data))
    ramp = npy_b64(episode_frames(8, 56, 56))
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
        # another task of the run first: the instruction probe borrows its text
        other = http.post("/score", json={"task_text": "open the drawer", "backend": QWEN, "frames_npy": ramp,
                                          "metadata": {"run": "r", "task_id": 2, "env_success": False}})
        assert other.status_code == 200
        answer = http.post("/score", json={"task_text": "put the bowl on the plate", "backend": QWEN,
                                           "frames_npy": ramp, "metadata": {"run": "r", "task_id": 1,
                                                                            "env_success": True, "episode_id": 5}})
        assert answer.json()["score"] == 0.9
        proxy.flush_audit()

        def probes_done():
            return (keys(http).get("1", {}).get("probes", {}).keys() >= {"reversed", "shuffled", "instruction"}
                    and keys(http)["1"])

        entry = wait_until(probes_done, HANG_S, "the three probes of task 1")
        # independently: reversed and shuffled frames are not rising, the other instruction is not the bowl
        for kind in ("reversed", "shuffled", "instruction"):
            assert entry["probes"][kind] == {"n": 1, "mean_margin": pytest.approx(0.9 - 0.3), "inversions": 0,
                                             "inversion_rate": 0.0}
        # probes are never episodes: the window holds the one scored episode of task 1
        assert entry["window"]["episodes"] == 1 and entry["episodes_seen"] == 1
        proxy.flush_audit()
        lines = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
        probes = {line["probe"]: line for line in lines if line.get("kind") == "probe"}
        assert probes["instruction"]["other_task"] == "open the drawer"
        assert probes["shuffled"]["order"] != sorted(probes["shuffled"]["order"])
        assert probes["reversed"]["frames"]["indices"] == sorted(probes["reversed"]["frames"]["indices"], reverse=True)
        assert all(p["margin"] == pytest.approx(0.6) and p["episode_id"] == 5 for p in probes.values())
        metrics = http.get("/metrics").text
        assert 'vlm_proxy_quality_probes_total{backend="qwen2_5_vl_vllm",outcome="scored",probe="reversed"}' in metrics
        margin = 'vlm_proxy_quality_probe_margin{backend="qwen2_5_vl_vllm",probe="shuffled",run="r",task="1"} '
        assert float(metrics.split(margin)[1].split()[0]) == pytest.approx(0.6)
        # task 2's episode had no other task to borrow from yet: its instruction probe is counted, not run
        assert 'outcome="no_other_task",probe="instruction"} 1.0' in metrics


def test_the_clients_success_threshold_decides_what_says_success(fake_vllm_factory, fake_primo, proxy_factory,
                                                                 media_root):
    """A run mapping with success_threshold 0.95: a failure scored 0.9 is no false success for it,
    while the proxy's default 0.5 would call every such failure one."""
    HACKED["task"] = 1  # failures scored 90
    qwen = fake_vllm_factory(served_model_name=QWEN_MODEL, record=False)
    qwen.fake.state.reply_fn = grade
    data = libero_settings_dict([qwen.base_url], [fake_primo.base_url], media_root)
    data["quality"] = {"window": 8, "alarm": {"min_episodes": 4, "min_per_outcome": 2}}
    proxy = proxy_factory(settings_from_dict(data))
    strict = [{**item, "metadata": {**item["metadata"], "success_threshold": 0.95}} for item in episodes(1, 0, 8)]
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
        score_all(http, strict)
        entry = keys(http)["1"]
        assert entry["window"]["threshold"] == 0.95 and entry["window"]["false_success_rate"] == 0.0
        score_all(http, episodes(1, 100, 8))  # no threshold sent: the proxy's 0.5
        entry = keys(http)["1"]
        assert entry["window"]["threshold"] == 0.5 and entry["window"]["false_success_rate"] == 1.0


def test_an_alarm_open_at_shutdown_is_written_as_reset_and_the_report_ends_its_period_there(
        fake_vllm_factory, fake_primo, proxy_factory, media_root, tmp_path):
    from reports.monitor_lines import AlarmLog, alarm_periods

    HACKED["task"] = 1
    qwen = fake_vllm_factory(served_model_name=QWEN_MODEL, record=False)
    qwen.fake.state.reply_fn = grade
    audit = tmp_path / "a.jsonl"
    data = libero_settings_dict([qwen.base_url], [fake_primo.base_url], media_root, audit_log=str(audit))
    data["quality"] = {"window": 8, "alarm": {"min_episodes": 4, "min_per_outcome": 2}}
    proxy = proxy_factory(settings_from_dict(data))
    with httpx.Client(base_url=proxy.url, timeout=60, trust_env=False) as http:
        assert score_all(http, episodes(1, 0, 8))[-1]["quality"]["status"] == "alarm"
    proxy.stop()  # a clean stop writes every queued line
    lines = [json.loads(line) for line in audit.read_text().splitlines()]
    transitions = [line for line in lines if line.get("kind") == "quality_alarm"]
    assert [t["status"] for t in transitions] == ["alarm", "reset"]
    alarms = AlarmLog()
    for n, line in enumerate(transitions):
        assert alarms.add(line, n) is None
    (period,) = alarm_periods(alarms, lines[0]["ts"], lines[-1]["ts"])
    assert not period["still_in_alarm"] and period["ended_by"] == "proxy stopped"
    assert period["cleared_ts"] == transitions[1]["ts"]
