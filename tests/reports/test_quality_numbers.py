"""The report's numbers and its reader, on small hand-made logs: each number against a slow,
obvious computation; the reader against the odd lines real logs hold."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
from pathlib import Path

import numpy as np
import pytest

from reports.audit import read_audit_log
from reports.quality import best_threshold, match_episodes, roc_auc, roc_curve
from tests.reports.expected import auc_by_pairs, best_by_trying
from vlm_protocol.frame_store import frame_path


def line(score: float | None, success: bool | None, *, backend: str = "b", task_id=0, episode_id=None,
         frames: list[str] | None = None, **extra) -> dict:
    metadata = {"task_id": task_id, **({"env_success": success} if success is not None else {}),
                **({"episode_id": episode_id} if episode_id is not None else {})}
    record = {"ts": 1.0, "backend": backend, "task_text": f"task #{episode_id}", "metadata": metadata,
              "frames": {"sha256": frames or [], "still_sha256": []}, **extra}
    if score is None:
        record["error"] = {"code": "unparseable_score", "message": "no score"}
    else:
        record.update(score=score, raw_score=score * 100, timings_ms={"total": 10.0}, model="m")
    return record


def write_log(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.mark.parametrize("seed", range(6))
def test_auc_and_best_threshold_match_brute_force_with_ties(seed):
    rng = random.Random(seed)
    scores = [rng.choice([0.0, 0.25, 0.5, 0.5, 0.75, 1.0, rng.random()]) for _ in range(60)]
    truth = [rng.random() < 0.4 + 0.3 * s for s in scores]
    assert roc_auc(scores, truth) == pytest.approx(auc_by_pairs(scores, truth), abs=1e-12)
    correct, threshold = best_by_trying(scores, truth)
    best = best_threshold(scores, truth)
    assert (best["correct"], best["threshold"]) == (correct, threshold)
    fpr, tpr = roc_curve(scores, truth)  # the trapezoids under the ROC curve are the same AUC
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0.0, 0.0, 1.0, 1.0)
    assert float(np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2)) == pytest.approx(auc_by_pairs(scores, truth))


def test_agreement_needs_both_outcomes_and_ignores_unknown_truth():
    assert roc_auc([0.2, 0.9], [1, 1]) is None and roc_curve([0.2], [0]) is None
    assert roc_auc([0.1, 0.9, 0.95], [0, 1, -1]) == 1.0  # -1: no env_success, left out
    assert best_threshold([0.9, 0.8], [0, 0]) == {"threshold": float("inf"), "correct": 2, "accuracy": 1.0}


def test_the_reader_counts_odd_lines_and_keeps_going(tmp_path):
    records = [line(0.9, True, unknown_key={"x": 1}), "", "{cut short", "[1, 2]", line(0.2, False),
               {"backend": "b", "score": 1.5}, {"backend": "b"}, line(0.7, None), line(None, True),
               {**line(0.4, True), "metadata": None}, line(0.6, "yes"), line(0.3, 1)]
    summary = read_audit_log(write_log(tmp_path / "a.jsonl", records))
    assert (summary.lines, summary.malformed) == (11, 4)
    assert [n for n, _ in summary.malformed_examples] == [3, 4, 6]  # the first three, by line number
    group = summary.backend_group("b")
    assert (group.lines, group.scored, group.parse_failures, group.truth_lines) == (7, 6, 1, 4)
    # task 0's episodes, then the one without metadata: "yes" is not a flag, 1 is
    assert list(group.truth) == [1, 0, -1, -1, 1, -1]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as fh:
        fh.write((tmp_path / "a.jsonl").read_text())
    assert read_audit_log(tmp_path / "a.jsonl.gz").backend_group("b").scored == 6


def test_comparison_lines_are_neither_episodes_nor_malformed(tmp_path):
    compare_ok = {"kind": "compare", "backend": "b", "label": 0, "metadata": [{"episode_id": 1}, {"episode_id": 2}]}
    compare_failed = {"kind": "compare", "backend": "b", "error": {"code": "unparseable_label"}}
    summary = read_audit_log(write_log(tmp_path / "a.jsonl", [line(0.9, True), compare_ok, compare_failed]))
    assert (summary.lines, summary.malformed, summary.records) == (3, 0, 1)
    assert summary.other_kinds == {"compare": 2}
    group = summary.backend_group("b")
    assert (group.lines, group.scored, sum(group.errors.values())) == (1, 1, 0)


def test_the_reader_keeps_only_the_worst_k(tmp_path):
    rng = random.Random(3)
    records = [line(rng.random(), rng.random() < 0.5, episode_id=i) for i in range(2000)]
    summary = read_audit_log(write_log(tmp_path / "a.jsonl", records), worst_k=5)
    expected = sorted((abs(r["score"] - r["metadata"]["env_success"]), i + 1) for i, r in enumerate(records))
    expected = sorted(expected, key=lambda t: (-t[0], t[1]))[:5]
    assert [(w.disagreement, w.line) for w in summary.worst("b")] == expected
    assert len(summary._worst["b"]) == 5  # bounded, whatever the log's length


def test_matching_two_logs_uses_the_last_line_of_an_episode(tmp_path):
    before = [line(0.2, True, episode_id=1), line(0.9, True, episode_id=1), line(0.1, False, episode_id=2),
              line(0.8, False, episode_id=3), line(None, True, episode_id=4), line(0.5, True, episode_id=5)]
    after = [line(0.8, True, episode_id=1), line(0.3, False, episode_id=2), line(0.2, False, episode_id=3),
             line(0.7, True, episode_id=4), line(0.5, False, episode_id=5), line(0.5, True, episode_id=6)]
    a = read_audit_log(write_log(tmp_path / "a.jsonl", before)).episodes["b"]
    b = read_audit_log(write_log(tmp_path / "b.jsonl", after)).episodes["b"]
    match = match_episodes(a, b, 0.5)
    # ep1 (last line 0.9 vs 0.8), ep2, ep3 compared; ep4 scored only after; ep5's truth differs.
    assert (match["matched"], match["compared"], match["duplicates_before"]) == (5, 3, 1)
    assert (match["scored_only_after"], match["truth_conflicts"], match["unmatched_after"]) == (1, 1, 1)
    assert match["accuracy"] == (pytest.approx(2 / 3), 1.0) and (match["fixed"], match["broken"]) == (1, 0)
    assert match["mean_abs_change"] == pytest.approx((0.1 + 0.2 + 0.6) / 3)


def _jpeg(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), colour).save(buffer, format="JPEG")
    return buffer.getvalue()


def test_a_frame_missing_from_the_store_is_drawn_and_said(tmp_path):
    pytest.importorskip("matplotlib")
    from PIL import Image

    from reports.contact_sheet import GAP, LABEL_H, THUMB, contact_sheet
    from reports.report import build_report

    store = tmp_path / "frames"
    jpegs = [_jpeg((0, 40 * i, 200)) for i in range(4)]
    hashes = [hashlib.sha256(j).hexdigest() for j in jpegs]
    for index, (data, digest) in enumerate(zip(jpegs, hashes, strict=True)):
        if index != 2:  # the third frame was never stored
            frame_path(store, digest).parent.mkdir(parents=True, exist_ok=True)
            frame_path(store, digest).write_bytes(data)
    sheet = contact_sheet(store, hashes, [])
    assert (sheet.frames, sheet.missing) == (4, 1)
    with Image.open(io.BytesIO(sheet.png)) as image:
        x = GAP + 2 * (THUMB + GAP) + 3
        assert image.convert("RGB").getpixel((x, GAP + LABEL_H + 3)) == (200, 200, 200)  # the grey tile
    log = write_log(tmp_path / "a.jsonl", [line(0.95, False, episode_id=7, frames=hashes), line(0.9, True)])
    build_report(log, out=tmp_path / "out", frame_store=store, worst=1)
    page = (tmp_path / "out" / "report.html").read_text()
    assert f"1 of 4 frames are missing from the frame store {store}" in page


def test_a_replay_is_matched_line_by_line_even_where_episode_ids_repeat(tmp_path):
    # two env workers both had an "env0-ep0": by episode id the two would collapse into one
    before = [line(0.9, True, episode_id="env0-ep0"), line(0.1, False, episode_id="env0-ep0")]
    # the replay finished them in the other order, each naming the line it replays
    after = [{**line(0.2, False, episode_id="env0-ep0"), "metadata": {"episode_id": "env0-ep0",
                                                                      "env_success": False, "replay_of_line": 2}},
             {**line(0.8, True, episode_id="env0-ep0"), "metadata": {"episode_id": "env0-ep0",
                                                                     "env_success": True, "replay_of_line": 1}}]
    a = read_audit_log(write_log(tmp_path / "a.jsonl", before)).episodes["b"]
    b = read_audit_log(write_log(tmp_path / "b.jsonl", after)).episodes["b"]
    match = match_episodes(a, b, 0.5)
    assert match["matched_by"] == "replay_of_line"
    assert (match["matched"], match["compared"], match["duplicates_before"]) == (2, 2, 0)
    assert match["mean_abs_change"] == pytest.approx((0.1 + 0.1) / 2)  # 0.9→0.8 and 0.1→0.2, never 0.9→0.2
    assert (match["fixed"], match["broken"], match["truth_conflicts"]) == (0, 0, 0)
