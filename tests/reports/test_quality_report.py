"""`report` on audit logs written by the real proxy: every number on the page is checked against
the same number computed here from the scores the grader gave (tests/reports/graded.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from reports.contact_sheet import COLUMNS, GAP, LABEL_H, THUMB  # noqa: E402
from tests.fakes.grader import FAILURE_RGB, SUCCESS_RGB  # noqa: E402
from tests.reports.expected import (  # noqa: E402
    auc_by_pairs,
    audit_lines,
    best_by_trying,
    correct_at,
    linear_percentile,
)
from tests.reports.graded import BACKENDS, EPISODES, GARBAGE, GARBAGE_REPLY, MALFORMED, PRIMO, QWEN  # noqa: E402
from tests.reports.pages import read_page  # noqa: E402

LINES_PER_BACKEND = len(EPISODES) + 1  # + the episode whose video is missing


def run_report(argv: list[str]) -> int:
    from vlm_reward_cli import build_parser

    args = build_parser().parse_args(["report", *argv])
    return args.func(args)


def expected_row(log, backend: str, threshold: float, task_id: int | None = None) -> dict[str, str]:
    scores, truth = log.graded(backend, task_id)
    successes, failures = sum(truth), len(truth) - sum(truth)
    correct = correct_at(scores, truth, threshold)
    best, best_at = best_by_trying(scores, truth)
    false_successes = sum(s >= threshold and not y for s, y in zip(scores, truth, strict=True))
    episodes = [e for e in log.episodes if task_id is None or e.task_id == task_id]
    lines = len(episodes) + (task_id in (None, 0))  # the missing-video episode is task 0
    garbage = sum(e.index in GARBAGE[backend] for e in episodes)
    errors = int(task_id in (None, 0))
    return {
        "episodes": str(lines), "scored": str(len(episodes) - garbage),
        "with env_success": f"{len(scores)} ({successes} ✓ / {failures} ✗)",
        "ROC-AUC": f"{auc_by_pairs(scores, truth):.3f}",
        "accuracy at threshold": f"{correct / len(scores):.1%} ({correct}/{len(scores)})",
        "best accuracy": f"{best / len(scores):.1%} ({best}/{len(scores)}) at ≥ {best_at:.3g}",
        "false successes": f"{false_successes}/{failures} ({false_successes / failures:.1%})",
        "parse failures": f"{garbage} ({garbage / lines:.1%})",
        "errors": f"{errors} ({errors / lines:.1%})",
    }


def check_numbers(page, graded, threshold: float) -> None:
    summary = page.table("Summary")
    for backend in BACKENDS:
        row = summary.row("backend", backend)
        expected = expected_row(graded, backend, threshold)
        assert {k: row[k] for k in expected} == expected
        latency = [r["timings_ms"]["total"] for r in audit_lines(graded.audit, backend) if "timings_ms" in r]
        assert row["latency ms p50 / p90 / p99"] == " / ".join(
            f"{linear_percentile(latency, q):,.0f}" for q in (50, 90, 99))
        tasks = page.table(f"Per task — {backend}")
        for task_id in (0, 1):
            task_row = tasks.row("task_id", str(task_id))
            expected = expected_row(graded, backend, threshold, task_id)
            assert {k: task_row[k] for k in expected} == expected


def check_alerts(page, graded) -> None:
    total = 2 * LINES_PER_BACKEND + len(MALFORMED)
    assert f"3 of {total} lines are not audit records and were skipped (first: line {total - 2}, not JSON" in page.alert
    assert f"PRIMO-R1: {2 / LINES_PER_BACKEND:.1%} of episodes (2 of {LINES_PER_BACKEND}) got a reply with no " \
           "readable score" in page.alert
    assert f"qwen2_5_vl_vllm: {1 / LINES_PER_BACKEND:.1%} of episodes (1 of {LINES_PER_BACKEND}) failed with an " \
           "error: media_not_found ×1" in page.alert
    assert GARBAGE_REPLY in page.text  # the replies that held no score are quoted
    health = page.table("Log:")
    assert health.row("fact", "malformed lines (skipped)")["value"] == "3"
    assert health.row("fact", "records without metadata.env_success (counted, not in agreement)")["value"] == "4"
    templates = page.table(f"Prompt templates seen — {QWEN}")
    sha = audit_lines(graded.audit, QWEN)[0]["prompt"]["sha256"]
    assert templates.rows == [{"template": "qwen_progress", "sha256": sha, "overrides": "",
                               "episodes": str(LINES_PER_BACKEND)}]


def _tile_centre(sheet: Image.Image, index: int) -> tuple[int, int, int]:
    x = GAP + (index % COLUMNS) * (THUMB + GAP) + THUMB // 2
    y = GAP + (index // COLUMNS) * (THUMB + LABEL_H + GAP) + LABEL_H + THUMB // 2
    return sheet.getpixel((x, y))


def check_worst(page, graded, out: Path, k: int) -> None:
    """The k largest |score - success| per backend, largest first, each with its frames from the
    store: the last video frame (and PRIMO's last still) shows the episode's painted outcome."""
    by_id = {e.episode_id: e for e in graded.episodes}
    for backend in BACKENDS:
        scores, truth = graded.graded(backend)
        expected = sorted((abs(s - y) for s, y in zip(scores, truth, strict=True)), reverse=True)[:k]
        shown = []
        for rank in range(1, k + 1):
            caption = next(c for c in page.figure_captions if c.startswith(f"{backend} #{rank}: "))
            episode = by_id[caption.split("episode ", 1)[1].split(",", 1)[0]]
            score = graded.expected_score(backend, episode)
            shown.append(abs(score - episode.success))
            assert f"score {score:.3f}" in caption and "missing" not in caption
            with Image.open(out / f"sheet-{backend.replace('-', '_')}-{rank}.png") as image:
                sheet = image.convert("RGB")
            painted = SUCCESS_RGB if episode.success else FAILURE_RGB
            for tile in ([15, 17] if backend == PRIMO else [15]):  # last video frame; PRIMO's last still
                centre = _tile_centre(sheet, tile)
                assert max(abs(a - b) for a, b in zip(centre, painted, strict=True)) < 40, (tile, centre, painted)
        assert shown == pytest.approx(expected)


def test_the_page_shows_the_agreement_the_grader_produced(graded, tmp_path, capsys):
    out = tmp_path / "report"
    assert run_report([str(graded.audit), "--out", str(out), "--frame-store", str(graded.store), "--worst", "3"]) == 0
    page = read_page(out / "report.html")
    check_numbers(page, graded, 0.5)
    check_alerts(page, graded)
    check_worst(page, graded, out, 3)
    # no quality_alarm line: no alarms.png
    assert {p.name for p in out.glob("*.png")} == {"roc.png"} | {
        f"{kind}-{b}.png" for kind in ("hist", "reliability") for b in ("qwen2_5_vl_vllm", "PRIMO_R1")} | {
        f"sheet-{b}-{r}.png" for b in ("qwen2_5_vl_vllm", "PRIMO_R1") for r in (1, 2, 3)}
    numbers = json.loads((out / "report.json").read_text())["logs"][0]["backends"][PRIMO]
    scores, truth = graded.graded(PRIMO)
    assert numbers["auc"] == pytest.approx(auc_by_pairs(scores, truth), abs=1e-12)
    assert numbers["errors_by_code"] == {"media_not_found": 1, "unparseable_score": 2}
    console = capsys.readouterr()
    assert f"PRIMO-R1: {LINES_PER_BACKEND} episodes, {len(scores)} with env_success; ROC-AUC " \
           f"{auc_by_pairs(scores, truth):.3f}" in console.out
    assert "WARNING: PRIMO-R1: 4.7% of episodes (2 of 43) got a reply with no readable score" in console.err

    # Another threshold moves accuracy and false successes, not the AUC; no sheets asked for.
    other = tmp_path / "at-0.62"
    assert run_report([str(graded.audit), "--out", str(other), "--success-threshold", "0.62", "--worst", "0"]) == 0
    page = read_page(other / "report.html")
    check_numbers(page, graded, 0.62)
    assert not list(other.glob("sheet-*")) and "Worst disagreements" not in page.text


def test_clear_errors_for_a_missing_or_empty_log(tmp_path, capsys):
    assert run_report([str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "nope.jsonl: no such audit log" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("\n\n")
    assert run_report([str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "empty.jsonl: the audit log is empty" in capsys.readouterr().err
    (tmp_path / "junk.jsonl").write_text("\n".join(MALFORMED) + "\n")
    assert run_report([str(tmp_path / "junk.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "none of its 3 lines is an audit record (first: line 1, not JSON" in capsys.readouterr().err
    assert run_report([str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "o"), "--frame-store",
                       str(tmp_path / "nowhere")]) == 2
    assert "--frame-store" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_command_line_registers_report():
    from vlm_reward_cli import build_parser

    args = build_parser().parse_args(["report", "a.jsonl", "--compare", "b.jsonl", "--out", "x"])
    assert (args.audit, args.compare, args.success_threshold, args.worst) == ("a.jsonl", "b.jsonl", 0.5, 8)
