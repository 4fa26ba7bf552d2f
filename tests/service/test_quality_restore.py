"""What a starting proxy rebuilds of the reward-quality monitor from an audit log it is given
(proxy/quality/restore.py), read through GET /quality of a real proxy on loopback: which lines
count (a replay never does; a dense curve's whole-episode point and a probe do), the bounds, and
what /quality says without a log. The stop-and-restart of one process is tests/faults/test_restart_monitor.py."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from proxy.config import settings_from_dict
from tests.conftest import libero_settings_dict
from tests.helpers import HANG_S

QWEN = "qwen2_5_vl_vllm"


def score_line(task: int, i: int, score: float, **extra) -> dict:
    success = i % 2 == 0
    return {"ts": 1_700_000_000 + i, "backend": QWEN, "task_text": f"task {task}", "score": score,
            "metadata": {"run": "runB", "task_id": task, "env_success": success, **extra.pop("metadata", {})}, **extra}


def write_log(path: Path, lines: list[dict]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def quality_of(proxy_factory, fake_qwen, fake_primo, media_root, audit: Path | None, **quality) -> dict:
    data = libero_settings_dict([fake_qwen.base_url], [fake_primo.base_url], media_root,
                                **({"audit_log": str(audit)} if audit else {}))
    data["quality"] = {"window": 8, "alarm": {"min_episodes": 4, "min_per_outcome": 2}, **quality}
    proxy = proxy_factory(settings_from_dict(data))
    with httpx.Client(timeout=HANG_S, trust_env=False) as http:
        body = http.get(f"{proxy.url}/quality").json()
    proxy.flush_audit()
    return body


def test_without_an_audit_log_quality_says_nothing_can_be_restored(proxy_factory, fake_qwen, fake_primo, media_root):
    body = quality_of(proxy_factory, fake_qwen, fake_primo, media_root, None)
    assert body["restore"]["restored"] is False and "no audit log" in body["restore"]["reason"]
    assert body["keys"] == []


def test_replays_never_count_and_a_dense_curve_counts_once_with_its_probes(proxy_factory, fake_qwen, fake_primo,
                                                                          media_root, tmp_path):
    audit = tmp_path / "audit.jsonl"
    lines = [score_line(1, i, 0.9 if i % 2 == 0 else 0.1) for i in range(6)]
    lines += [score_line(1, i, 0.9, metadata={"replay_of_line": i}) for i in range(10)]  # a replay: ignored
    # a dense curve of task 2: two prefixes, the last marked as the episode the monitor saw
    lines += [score_line(2, 0, 0.4, kind="dense_point", dense={"point": 0, "points": 2, "curve": "c"}),
              score_line(2, 0, 0.8, kind="dense_point", dense={"point": 1, "points": 2, "curve": "c", "episode": True})]
    lines += [{"ts": 1_700_000_100, "kind": "probe", "probe": "reversed", "run": "runB", "backend": QWEN,
               "task_id": "1", "original_score": 0.9, "probe_score": 0.3, "task_text": "task 1"}]
    lines += [{"kind": "compare", "backend": QWEN}, "not json"]
    audit.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    body = quality_of(proxy_factory, fake_qwen, fake_primo, media_root, audit)
    keys = {entry["key"]["task_id"]: entry for entry in body["keys"]}
    assert keys["1"]["window"]["n"] == 6 and keys["1"]["window"]["auc"] == 1.0
    assert keys["1"]["probes"]["reversed"]["n"] == 1 and keys["1"]["probes"]["reversed"]["mean_margin"] == 0.9 - 0.3
    assert keys["2"]["window"]["n"] == 1 and keys["2"]["window"]["mean_score_success"] == 0.8
    assert keys["1"]["restored_from"] == {"episodes": 6, "from_ts": 1_700_000_000, "to_ts": 1_700_000_005}
    assert body["restore"]["lines_read"] == len(lines) and body["restore"]["stopped_by"] == "start_of_log"


def test_the_rebuild_reads_at_most_max_lines_the_newest(proxy_factory, fake_qwen, fake_primo, media_root, tmp_path):
    audit = tmp_path / "audit.jsonl"
    write_log(audit.with_name("audit.jsonl.1"), [score_line(1, i, 0.5) for i in range(10)])  # older: never read
    write_log(audit, [score_line(1, i, 0.9 if i % 2 == 0 else 0.1) for i in range(10, 14)])
    body = quality_of(proxy_factory, fake_qwen, fake_primo, media_root, audit, restore={"max_lines": 6})
    assert body["restore"]["stopped_by"] == "max_lines" and body["restore"]["lines_read"] == 6
    assert body["restore"]["files"] == [str(audit), str(audit.with_name("audit.jsonl.1"))]
    [key] = body["keys"]
    assert key["window"]["n"] == 6 and key["window"]["mean_score_success"] == (0.9 + 0.9 + 0.5) / 3


def test_an_alarm_reset_at_a_stop_is_open_again_and_says_it_was_restored(proxy_factory, fake_qwen, fake_primo,
                                                                       media_root, tmp_path):
    """Only the monitor's lines of a key whose episodes rotated away: the numbers as last judged."""
    audit = tmp_path / "audit.jsonl"
    numbers = {"n": 8, "auc": 0.3, "false_success_rate": 0.75, "accuracy": 0.4, "episodes": 8}
    write_log(audit, [{"ts": 1, "kind": "quality_alarm", "run": "runB", "backend": QWEN, "task_id": "3",
                       "status": "reset", "reason": "the proxy stopped", "alarm_reason": "false-success rate 0.75",
                       "numbers": numbers, "episodes_seen": 40, "first_window": {"n": 8, "auc": 0.9}}])
    body = quality_of(proxy_factory, fake_qwen, fake_primo, media_root, audit)
    [key] = body["keys"]
    assert (key["status"], key["reason"], key["episodes_seen"]) == ("alarm", "false-success rate 0.75", 40)
    assert key["window"] == numbers and key["first_window"] == {"n": 8, "auc": 0.9}
    assert body["status"] == "alarm" and body["restore"]["alarms"] == 1
    # the log says the alarm is open again (report: a new period from the restart), no transition counted
    restored = json.loads(audit.read_text().splitlines()[-1])
    assert (restored["kind"], restored["status"], restored["restored"]) == ("quality_alarm", "alarm", True)
    assert restored["reason"] == "false-success rate 0.75" and restored["episodes_seen"] == 40


def test_a_cascades_stages_are_restored_under_their_own_keys(proxy_factory, fake_qwen, fake_primo, media_root,
                                                             tmp_path):
    """A cascade's line carries each stage that ran: the stage keys come back beside the cascade's,
    and so do its escalation numbers."""
    audit = tmp_path / "audit.jsonl"
    lines = []
    for i in range(6):
        cheap, final = (0.9, 0.8) if i % 2 == 0 else (0.7, 0.2)  # the cheap stage is wrong on failures
        stages = [{"backend": "p_done", "score": cheap, "went_on": "band"}, {"backend": "PRIMO-R1", "score": final}]
        lines.append(score_line(4, i, final, backend="p_done_then_primo", stopped=None,
                                cascade={"stages": stages, "threshold": 0.5}))
    write_log(audit, lines)
    body = quality_of(proxy_factory, fake_qwen, fake_primo, media_root, audit)
    keys = {entry["key"]["backend"]: entry["window"] for entry in body["keys"]}
    assert keys["p_done_then_primo"]["n"] == 6 and keys["p_done_then_primo"]["mean_score_success"] == pytest.approx(0.8)
    assert keys["p_done_then_primo/p_done"]["n"] == 6 and keys["p_done_then_primo/p_done"]["false_success_rate"] == 1.0
    assert keys["p_done_then_primo/PRIMO-R1"]["mean_score_failure"] == pytest.approx(0.2)
    [watched] = body["cascades"]  # the escalation rate over the restored window: every episode went on
    assert watched["key"]["backend"] == "p_done_then_primo" and watched["stages"]["p_done"]["escalation_rate"] == 1.0
