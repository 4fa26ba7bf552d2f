"""The report's alarm, probe and calibration sections, on a hand-made log that mixes episodes with
the live monitor's `quality_alarm` and `probe` lines: every number on the page and in report.json
against an independent computation here, and the monitor's lines never counted as episodes."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from tests.reports.pages import read_page  # noqa: E402
from tests.reports.test_quality_numbers import line, write_log  # noqa: E402
from tests.reports.test_quality_report import run_report  # noqa: E402

T0 = 1795700000.0
QWEN, PRIMO = "qwen2_5_vl_vllm", "PRIMO-R1"
REASON = "false-success rate 0.45 > 0.3 over the last 64 scored episodes"
RAISED_NUMBERS = {"n": 64, "auc": 0.55, "false_success_rate": 0.45, "accuracy": 0.6, "threshold": 0.5}
EDGES = [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 1.0]  # scores on bin edges: each belongs to the bin it opens (1.0: the last)


def episodes() -> list[dict]:
    """200 episodes over two backends and tasks 0, 1 (some without env_success, a few parse failures),
    one a second apart from T0."""
    rng = random.Random(7)
    records = []
    for i in range(200):
        success = rng.random() < 0.4
        score = EDGES[i % len(EDGES)] if i % 5 == 0 else (
            rng.randint(0, 100) / 100 if i % 2 else min(1.0, max(0.0, rng.gauss(0.7 if success else 0.35, 0.2))))
        truth = None if i % 17 == 3 else success
        record = line(None if i % 23 == 11 else score, truth, backend=(QWEN, PRIMO)[i % 2], task_id=(i // 2) % 2,
                      episode_id=f"ep{i}")
        records.append({**record, "ts": T0 + i * 5})  # the log spans T0 .. T0 + 995
    return records


def alarm(ts: float, status: str, *, run: str | None, backend: str, task: str, reason: str | None = REASON,
          numbers: dict | None = None, seen: int = 180) -> dict:
    return {"ts": ts, "kind": "quality_alarm", "run": run, "backend": backend, "task_id": task, "status": status,
            "reason": reason if status == "alarm" else None,
            "numbers": numbers or (RAISED_NUMBERS if status == "alarm" else {"n": 64, "auc": 0.8}),
            "episodes_seen": seen}


ALARMS = [
    alarm(T0 + 50, "ok", run=None, backend=PRIMO, task="1"),  # its raise was before the log (rotated away)
    alarm(T0 + 100, "alarm", run="runB", backend=QWEN, task="4"),
    alarm(T0 + 200, "alarm", run="runC", backend=PRIMO, task="0", reason="ROC-AUC 0.52 < 0.6"),
    alarm(T0 + 250, "alarm", run="runC", backend=PRIMO, task="0", reason="again"),  # a proxy restart: no clear
    alarm(T0 + 300, "ok", run="runC", backend=PRIMO, task="0"),
    alarm(T0 + 400, "ok", run="runB", backend=QWEN, task="4"),
    alarm(T0 + 700, "alarm", run="runB", backend=QWEN, task="4", seen=900),  # still in alarm at the end
]


def probes() -> list[dict]:
    rng = random.Random(11)
    records = []
    for i in range(90):
        kind = ("reversed", "shuffled", "instruction")[i % 3]
        original = rng.randint(0, 20) / 20
        # reversed: noticed (mostly lower); shuffled and instruction: ignored (noise around the original)
        drop = 0.3 if kind == "reversed" else 0.0
        probe = original if i % 7 == 0 else min(1.0, max(0.0, round(original - drop + rng.uniform(-0.2, 0.2), 2)))
        record = {"ts": T0 + 2 * i + 1, "kind": "probe", "probe": kind, "run": "runB", "backend": (QWEN, PRIMO)[i % 2],
                  "task_id": str(i % 4 + 3), "episode_id": f"ep{i}", "original_score": original, "probe_score": probe,
                  "margin": round(original - probe, 6),
                  # as the proxy writes it: the episode's metadata, env_success included (never an episode)
                  "task_text": "put the bowl on the plate", "metadata": {"task_id": i % 4 + 3, "env_success": True}}
        if kind == "shuffled":
            record["seed"] = 123 + i
        if kind == "instruction":
            record["other_task"] = "open the top drawer"
        records.append(record)
    return records


FAILED_PROBE = {"ts": T0 + 500, "kind": "probe", "probe": "reversed", "backend": QWEN, "task_id": "3",
                "error": {"code": "upstream_timeout", "message": "slow"}}
BAD = [{"ts": T0 + 1, "kind": "quality_alarm", "status": "maybe", "backend": QWEN},  # neither alarm nor ok
       {"kind": "quality_alarm", "status": "alarm", "backend": QWEN},  # no ts: cannot be placed in time
       {"ts": T0 + 2, "kind": "probe", "probe": "reversed", "backend": QWEN, "original_score": 0.5,
        "probe_score": 1.5}]


def mixed(path: Path) -> Path:
    """Episodes, alarm and probe lines interleaved by time, as one proxy writes them; then the odd lines."""
    records = sorted([*episodes(), *ALARMS, *probes(), FAILED_PROBE], key=lambda r: r["ts"])
    return write_log(path, [*records, *BAD])


def utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def known(backend: str, task: int | None = None) -> list[tuple[float, bool]]:
    """(score, success) of the episodes that count: scored, env_success known."""
    return [(r["score"], r["metadata"]["env_success"]) for r in episodes()
            if r["backend"] == backend and "score" in r and "env_success" in r["metadata"]
            and (task is None or r["metadata"]["task_id"] == task)]


def bins_by_decimal(pairs: list[tuple[float, bool]]) -> list[tuple[int, int]]:
    """(episodes, successes) per bin [i/10, (i+1)/10), 1.0 in the last, reading each score as written."""
    out = []
    for i in range(10):
        low, high = Decimal(i) / 10, Decimal(i + 1) / 10
        inside = [y for s, y in pairs if low <= Decimal(repr(s)) < high or (i == 9 and Decimal(repr(s)) == 1)]
        out.append((len(inside), sum(inside)))
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("monitor")
    out = tmp / "out"
    assert run_report([str(mixed(tmp / "audit.jsonl")), "--out", str(out)]) == 0
    plain = tmp / "plain"  # the same episodes, without a single monitor line
    assert run_report([str(write_log(tmp / "plain.jsonl", episodes())), "--out", str(plain)]) == 0
    return {"out": out, "page": read_page(out / "report.html"), "json": json.loads((out / "report.json").read_text()),
            "plain": plain, "plain_page": read_page(plain / "report.html"),
            "plain_json": json.loads((plain / "report.json").read_text())}


def test_monitor_lines_are_never_episodes(report):
    [log], [plain] = report["json"]["logs"], report["plain_json"]["logs"]
    assert log["backends"] == plain["backends"] and log["tasks"] == plain["tasks"]
    assert log["calibration"] == plain["calibration"]
    for backend in (QWEN, PRIMO):
        lines = sum(r["backend"] == backend for r in episodes())
        assert log["backends"][backend]["lines"] == lines == 100
        assert report["page"].table("Summary").row("backend", backend)["episodes"] == str(lines)
    assert log["other_kinds"] == {"probe": len(probes()) + 1, "quality_alarm": len(ALARMS)}
    assert log["malformed"] == len(BAD)  # counted as malformed, not as other lines too
    health = report["page"].table("Log:")
    total = len(episodes()) + len(ALARMS) + len(probes()) + 1 + len(BAD)
    assert health.row("fact", "lines read")["value"] == str(total)
    assert health.row("fact", "audit records")["value"] == str(len(episodes()))
    assert health.row("fact", "other lines, never episodes (by kind)")["value"] == \
        f"probe ×{len(probes()) + 1}, quality_alarm ×{len(ALARMS)}"
    assert "3 of " in report["page"].alert and "a quality_alarm line without a status" in report["page"].alert


EXPECTED_PERIODS = [  # (run, backend, task, raised, cleared, reason, repeated raises), in key order
    (None, PRIMO, "1", None, T0 + 50, None, 0),
    ("runB", QWEN, "4", T0 + 100, T0 + 400, REASON, 0),
    ("runB", QWEN, "4", T0 + 700, None, REASON, 0),
    ("runC", PRIMO, "0", T0 + 200, T0 + 300, "ROC-AUC 0.52 < 0.6", 1),
]


def test_alarm_periods_are_what_the_lines_say(report):
    periods = report["json"]["logs"][0]["alarms"]
    assert [(p["run"], p["backend"], p["task_id"], p["raised_ts"], p["cleared_ts"], p["reason"], p["repeated_raises"])
            for p in periods] == EXPECTED_PERIODS
    last_ts = T0 + 995  # the last episode
    assert [p["still_in_alarm"] for p in periods] == [False, False, True, False]
    assert [(p["from_ts"], p["to_ts"]) for p in periods] == [  # the first key's raise is not in the log
        (T0, T0 + 50), (T0 + 100, T0 + 400), (T0 + 700, last_ts), (T0 + 200, T0 + 300)]
    assert [p["duration_s"] for p in periods] == pytest.approx([50, 300, last_ts - (T0 + 700), 100])
    assert periods[1]["numbers"] == RAISED_NUMBERS and periods[1]["episodes_seen"] == 180
    assert periods[2]["episodes_seen"] == 900 and periods[0]["numbers"] is None

    rows = report["page"].table("Alarm periods").rows
    assert [(r["run"], r["backend"], r["task_id"], r["raised"], r["cleared"]) for r in rows] == [
        ("—", PRIMO, "1", "not in this log (rotated away?)", utc(T0 + 50)),
        ("runB", QWEN, "4", utc(T0 + 100), utc(T0 + 400)),
        ("runB", QWEN, "4", utc(T0 + 700), "still in alarm at the end of the log"),
        ("runC", PRIMO, "0", utc(T0 + 200), utc(T0 + 300))]
    assert [r["time in alarm"] for r in rows] == ["≥ 50.0 s", "5.0 min", "≥ 4.9 min", "1.7 min"]
    assert rows[1]["reason at the raise"] == REASON
    assert rows[1]["numbers at the raise"] == "n 64, ROC-AUC 0.550, false-success rate 45.0%, accuracy 60.0%"
    assert rows[1]["episodes seen at the raise"] == "180"
    assert rows[3]["reason at the raise"] == "ROC-AUC 0.52 < 0.6 (raised again ×1 before it cleared)"

    assert "Alarms over time (alarms.png)" in report["page"].figure_captions
    with Image.open(report["out"] / "alarms.png") as image:  # one bar per key, said in the PNG's text
        assert image.text["Description"] == ("(no run) / PRIMO-R1 / task 1: cleared; runB / qwen2_5_vl_vllm / task 4: "
                                             "cleared; runB / qwen2_5_vl_vllm / task 4: still in alarm; "
                                             "runC / PRIMO-R1 / task 0: cleared")
        red = image.convert("RGB").getcolors(1 << 20)
        assert any(r > 180 and g < 120 and b < 120 for _, (r, g, b) in red)  # the bars are drawn


def test_alarm_periods_from_transitions_out_of_order():
    from reports.monitor_lines import AlarmLog, alarm_periods

    alarms = AlarmLog()
    lines = [alarm(T0 + 30, "ok", run="r", backend="b", task="1"),  # raised before the log
             alarm(T0 + 90, "ok", run="r", backend="b", task="1"),  # raised again after T0 + 30, not logged
             alarm(T0 + 60, "alarm", run="r", backend="b", task="1", reason="late line"),  # an older file's, later
             alarm(T0 + 120, "alarm", run="r", backend="b", task="1", reason="open")]
    for number, record in enumerate(lines, start=1):
        assert alarms.add(record, number) is None
    assert alarms.add({"ts": T0, "kind": "quality_alarm", "status": "alarm"}, 9) is None  # no backend: still a key
    periods = [p for p in alarm_periods(alarms, T0, T0 + 150) if p["backend"] == "b"]
    assert [(p["raised_ts"], p["cleared_ts"], p["from_ts"], p["to_ts"], p["reason"]) for p in periods] == [
        (None, T0 + 30, T0, T0 + 30, None), (T0 + 60, T0 + 90, T0 + 60, T0 + 90, "late line"),
        (T0 + 120, None, T0 + 120, T0 + 150, "open")]


def test_a_log_of_monitor_lines_only_is_a_clear_error(tmp_path, capsys):
    audit = write_log(tmp_path / "monitor.jsonl", [*ALARMS[:2], *probes()[:3]])
    assert run_report([str(audit), "--out", str(tmp_path / "out")]) == 2
    assert "none of its 5 lines is an episode's audit record (only probe ×3, quality_alarm ×2)" in \
        capsys.readouterr().err


def test_a_log_without_alarms_says_so(report):
    assert "No alarm in this log." in report["plain_page"].text
    assert "No invariance probe in this log." in report["plain_page"].text
    assert not (report["plain"] / "alarms.png").exists()
    assert report["plain_json"]["logs"][0]["alarms"] == [] and report["plain_json"]["logs"][0]["probes"] == {}


def expected_probes() -> dict[tuple[str, str, str], tuple[int, float, int]]:
    """(probes, mean margin, inversions) per (backend, task or "all tasks", probe kind)."""
    pairs = defaultdict(list)
    for r in probes():
        for task in (r["task_id"], "all tasks"):
            pairs[(r["backend"], task, r["probe"])].append((r["original_score"], r["probe_score"]))
    return {key: (len(v), sum(o - p for o, p in v) / len(v), sum(p >= o for o, p in v)) for key, v in pairs.items()}


def test_probe_means_and_inversions_match_an_independent_count(report):
    expected = expected_probes()
    measured = report["json"]["logs"][0]["probes"]
    rows = report["page"].table("Invariance probes").rows
    assert len(rows) == len(expected)
    for (backend, task, kind), (n, margin, inversions) in expected.items():
        numbers = measured[backend]["all" if task == "all tasks" else "tasks"]
        numbers = numbers[kind] if task == "all tasks" else numbers[task][kind]
        assert (numbers["n"], numbers["inversions"]) == (n, inversions)
        assert numbers["mean_margin"] == pytest.approx(margin, abs=1e-12)
        assert numbers["inversion_rate"] == pytest.approx(inversions / n)
        [row] = [r for r in rows if (r["backend"], r["task_id"], r["probe"]) == (backend, task, kind)]
        assert (row["probes"], row["mean margin"], row["inversions"]) == (
            str(n), f"{margin:+.3f}", f"{inversions} ({inversions / n:.1%})")
    # the failed probe is an error of its group, not a probe
    assert measured[QWEN]["tasks"]["3"]["reversed"]["errors_by_code"] == {"upstream_timeout": 1}
    assert [r["probe"] for r in rows[:3]] == ["reversed", "shuffled", "instruction"]
    # the log was built so: reversing is noticed, shuffling and another instruction are not
    assert measured[QWEN]["all"]["reversed"]["mean_margin"] > 0.15
    assert abs(measured[QWEN]["all"]["shuffled"]["mean_margin"]) < 0.1


def test_brier_and_reliability_bins_match_brute_force(report):
    calibration = report["json"]["logs"][0]["calibration"]
    page = report["page"]
    for backend in (QWEN, PRIMO):
        pairs = known(backend)
        brier = sum((s - y) ** 2 for s, y in pairs) / len(pairs)
        rate = sum(y for _, y in pairs) / len(pairs)
        numbers = calibration[backend]
        assert numbers["n"] == len(pairs) and numbers["brier"] == pytest.approx(brier, abs=1e-12)
        assert numbers["brier_constant"] == pytest.approx(rate * (1 - rate))
        row = page.table("Brier score per backend").row("backend", backend)
        assert (row["episodes with env_success"], row["Brier"]) == (str(len(pairs)), f"{brier:.3f}")
        bins = bins_by_decimal(pairs)
        assert [(b["n"], b["successes"]) for b in numbers["bins"]] == bins
        assert sum(n for n, _ in bins) == len(pairs)
        for b, (n, hits) in zip(numbers["bins"], bins, strict=True):
            assert b["rate"] == (hits / n if n else None)
        shown = page.table(f"Reliability bins — {backend}").rows
        assert [(r["score bin"], r["episodes"], r["observed success rate"]) for r in shown] == [
            (f"[{i / 10:.1f}, {(i + 1) / 10:.1f}{']' if i == 9 else ')'}", str(n), f"{h / n:.1%}" if n else "—")
            for i, (n, h) in enumerate(bins)]
        tasks = page.table(f"Brier score per task — {backend}")
        for task in (0, 1):
            task_pairs = known(backend, task)
            task_brier = sum((s - y) ** 2 for s, y in task_pairs) / len(task_pairs)
            assert numbers["tasks"][str(task)]["brier"] == pytest.approx(task_brier, abs=1e-12)
            assert tasks.row("task_id", str(task))["Brier"] == f"{task_brier:.3f}"
        assert f"Reliability diagram — {backend} (reliability-{backend.replace('-', '_')}.png)" in page.figure_captions
    # an edge score opens its bin: 0.3 is in [0.3, 0.4), 1.0 in [0.9, 1.0]
    edge = [(0.3, True), (1.0, False), (0.0, False)]
    assert [n for n, _ in bins_by_decimal(edge)] == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1]
    from reports.quality import reliability

    assert [b["n"] for b in reliability([0.3, 1.0, 0.0], [1, 0, 0])] == [1, 0, 0, 1, 0, 0, 0, 0, 0, 1]


def test_the_new_sections_read_in_a_browser(report):
    from tests.reports.browser import assert_not_blank, chromium, dom_text, screenshot

    chromium()  # skips (or fails under CI) without one
    page = report["out"] / "report.html"
    assert_not_blank(screenshot(page, report["out"].parent / "monitor.png"))
    text = dom_text(page)
    for words in ("Alarms over time", "still in alarm at the end of the log", "Invariance probes",
                  "Calibration", "Brier score per backend", utc(T0 + 700)):
        assert words in text, words
