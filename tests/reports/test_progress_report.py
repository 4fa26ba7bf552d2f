"""`kind: progress` audit lines (POST /progress/batch, run D) in the reward-quality report: measured
apart from /score episodes, never counted as scored episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reports.audit import read_audit_log
from reports.progress_quality import progress_numbers
from reports.quality import group_numbers
from tests.reports.test_quality_numbers import line, write_log

pytest.importorskip("matplotlib")


def progress_line(outcome: str | None, progress: float | None, success: bool, *, task_id=0, backend="embed",
                  error: str | None = None, total_ms: float = 20.0) -> dict:
    record = {"ts": 2.0, "kind": "progress", "backend": backend, "task_text": f"task {task_id}",
              "metadata": {"task_id": task_id, "env_success": success, "episode_id": "env0-ep1", "run": "runD_srpo"},
              "frames": {"count": 16, "sha256": []}, "endpoint": "http://127.0.0.1:8011/v1",
              "usage": {"prompt_tokens": 900}, "timings_ms": {"total": total_ms}}
    if error:
        return {**record, "error": {"code": error, "message": "failed"}}
    return {**record, "outcome": outcome, "progress": progress, "distance": None, "normalised_distance": None,
            "reference": {"batch_successes": 1, "stored": 3, "centres": 1, "failures": 4}}


TASK0 = [0.1, 0.5, 0.9, 0.3]  # the failures' progress in task 0
PROGRESS = [
    progress_line("success", 1.0, True), progress_line("success", 1.0, True),
    *(progress_line("progress", p, False, total_ms=10.0 * (i + 1)) for i, p in enumerate(TASK0)),
    progress_line("no_reference", None, False),
    progress_line(None, None, False, error="progress_group_failed"),
    progress_line("no_reference", None, False, task_id=1), progress_line("no_reference", None, False, task_id=1),
]
SCORES = [line(0.9, True), line(0.2, False), line(0.7, False, task_id=1), line(None, True)]
BAD = [{"kind": "progress", "backend": "embed", "outcome": "progress", "progress": None},
       {"kind": "progress", "backend": "embed", "outcome": "no_reference", "progress": 0.0},
       {"kind": "progress", "backend": "embed", "outcome": "success", "progress": 1.7}]


def mixed_log(path: Path) -> Path:
    records = []
    for i in range(max(len(PROGRESS), len(SCORES))):  # interleaved, as one proxy serving both writes them
        records += PROGRESS[i:i + 1] + SCORES[i:i + 1]
    compare = {"kind": "compare", "backend": "qwen", "label": 1}
    return write_log(path, [*records, compare, *BAD])


def test_progress_lines_are_measured_apart_and_never_as_scored_episodes(tmp_path):
    mixed = read_audit_log(mixed_log(tmp_path / "mixed.jsonl"))
    scores_only = read_audit_log(write_log(tmp_path / "scores.jsonl", SCORES))
    # the /score numbers are exactly those of the same log without progress lines
    assert mixed.backends() == scores_only.backends() == ["b"]
    assert group_numbers(mixed.backend_group("b"), 0.5) == group_numbers(scores_only.backend_group("b"), 0.5)
    assert mixed.episodes["b"].keys == scores_only.episodes["b"].keys
    assert (mixed.lines, mixed.malformed, mixed.other_kinds) == (len(PROGRESS) + len(SCORES) + 1 + 3, 3,
                                                                 {"compare": 1})
    assert mixed.records == len(PROGRESS) + len(SCORES)
    assert [why for _, why in mixed.malformed_examples] == [
        "a progress line with outcome progress without a progress in [0, 1]",
        "a progress line with outcome no_reference and a progress",
        "a progress line with outcome success without a progress in [0, 1]"]
    assert mixed.progress.backends() == ["embed"] and mixed.progress.tasks("embed") == ["0", "1"]


def test_the_failures_progress_per_task(tmp_path):
    progress = read_audit_log(mixed_log(tmp_path / "mixed.jsonl")).progress
    task0 = progress_numbers(progress.groups[("embed", "0")])
    ordered = sorted(TASK0)  # 0.1 0.3 0.5 0.9: the median halfway between 0.3 and 0.5
    assert task0.pop("errors_by_code") == {"progress_group_failed": 1}
    assert task0 == pytest.approx({
        "lines": 8, "successes": 2, "failures": 5, "rated": 4, "no_reference": 1, "no_reference_rate": 1 / 5,
        "alone": 0, "alone_rate": 0.0,  # each normalised over the task's 4 failures
        "progress_mean": sum(TASK0) / 4, "progress_std": task0["progress_std"],
        "progress_p10": ordered[0] + 0.3 * (ordered[1] - ordered[0]), "progress_p25": ordered[0] + 0.75 * 0.2,
        "progress_p50": 0.4, "progress_p75": 0.5 + 0.25 * 0.4, "progress_p90": 0.5 + 0.7 * 0.4,
        "errors": 1, "error_rate": 1 / 8,
        "latency_p50": 20.0, "latency_p99": task0["latency_p99"]})
    assert task0["progress_std"] == pytest.approx((sum((p - 0.45) ** 2 for p in TASK0) / 4) ** 0.5)
    task1 = progress_numbers(progress.groups[("embed", "1")])
    assert (task1["failures"], task1["rated"], task1["no_reference"], task1["progress_mean"]) == (2, 0, 2, None)
    assert task1["no_reference_rate"] == 1.0 and task1["progress_p50"] is None
    everything = progress_numbers(progress.backend_group("embed"))
    assert (everything["lines"], everything["failures"], everything["no_reference"]) == (10, 7, 3)


def test_a_log_of_progress_lines_only_is_a_report(tmp_path, capsys):
    from tests.reports.test_quality_report import run_report

    audit = write_log(tmp_path / "d.jsonl", PROGRESS)
    out = tmp_path / "out"
    assert run_report([str(audit), "--out", str(out)]) == 0
    result = json.loads((out / "report.json").read_text())
    [log] = result["logs"]
    assert log["backends"] == {} and set(log["progress"]) == {"embed"}
    assert log["progress"]["embed"]["tasks"]["0"]["progress_mean"] == pytest.approx(0.45)
    # one item in ten failed (task 1 had no reference, but the backend's other failures had)
    assert result["alerts"] == ["embed (progress): 10.0% of items (1 of 10) failed: progress_group_failed ×1"]
    console = capsys.readouterr().out
    assert ("embed (progress): 10 items, 2 successes, 7 failures (3 without a reference); failures' progress mean "
            "0.450, median 0.400; errors 1") in console


def test_the_page_has_a_progress_section_per_task(tmp_path):
    from tests.reports.pages import read_page
    from tests.reports.test_quality_report import run_report

    out = tmp_path / "out"
    assert run_report([str(mixed_log(tmp_path / "mixed.jsonl")), "--out", str(out)]) == 0
    page = read_page(out / "report.html")
    row = page.table("Progress per backend").row("backend", "embed")
    assert row["failures (rated / no reference)"] == "7 (4 / 3)" and row["no reference"] == "42.9%"
    tasks = page.table("Progress of failures per task — embed")
    assert tasks.row("task_id", "0")["progress p10 / p25 / p50 / p75 / p90"] == "0.160 / 0.250 / 0.400 / 0.600 / 0.780"
    assert tasks.row("task_id", "1")["progress mean ± std"] == "—"
    assert page.table("Summary").row("backend", "b")["episodes"] == "4"  # progress lines are not episodes
    assert "embed" not in [r["backend"] for r in page.table("Summary").rows]


def test_no_reference_for_every_failure_is_an_alert(tmp_path):
    from reports.report import build_report

    audit = write_log(tmp_path / "d.jsonl", [progress_line("success", 1.0, True, task_id=2),
                                             progress_line("no_reference", None, False, task_id=3)])
    result = build_report(audit, out=tmp_path / "out")
    assert result["alerts"] == ["embed (progress): none of its 1 failures had a reference, so every one was paid "
                                "the native reward: is the proxy's reference_store on?"]


def test_failures_alone_in_their_normalisation_are_counted_and_alerted(tmp_path):
    alone = [{**progress_line("progress", 0.5, False), "reference": {"batch_successes": 0, "stored": 2, "centres": 1,
                                                                    "failures": 1}} for _ in range(3)]
    shared = [progress_line("progress", p, False) for p in (0.2, 0.8)]
    from reports.progress_quality import measure_progress, progress_alerts

    log = read_audit_log(write_log(tmp_path / "alone.jsonl", [*alone, *shared]))
    measured = measure_progress(log.progress)
    numbers = measured["embed"]["all"]
    assert (numbers["rated"], numbers["alone"], numbers["alone_rate"]) == (5, 3, pytest.approx(0.6))
    assert any("only failure of their task" in line for line in progress_alerts(measured))
    quiet = measure_progress(read_audit_log(write_log(tmp_path / "shared.jsonl", [*alone[:1], *shared])).progress)
    assert not any("only failure" in line for line in progress_alerts(quiet))
