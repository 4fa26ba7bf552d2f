"""`report BEFORE --compare AFTER`: the same episodes graded twice through the real proxy (the
second grader noisier, as a worse prompt would be), side by side, checked against numbers
computed here from the grader's scores."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from PIL import Image  # noqa: E402

from tests.reports.expected import auc_by_pairs, best_by_trying, correct_at  # noqa: E402
from tests.reports.graded import BACKENDS, EPISODES, build_graded_log  # noqa: E402
from tests.reports.pages import read_page  # noqa: E402


def test_two_logs_side_by_side(proxy_factory, fake_vllm_factory, media_root, tmp_path):
    from vlm_reward_cli import main

    store = tmp_path / "frames"  # shared, as replay shares the original run's store
    before = build_graded_log(proxy_factory, fake_vllm_factory, media_root, tmp_path, seed=0, noise=18,
                              name="before.jsonl", store=store)
    after = build_graded_log(proxy_factory, fake_vllm_factory, media_root, tmp_path, seed=7, noise=35,
                             name="after.jsonl", store=store)
    out = tmp_path / "compare"
    assert main(["report", str(before.audit), "--compare", str(after.audit), "--out", str(out),
                 "--frame-store", str(store), "--worst", "2"]) == 0
    page = read_page(out / "report.html")
    for backend in BACKENDS:
        (s_before, truth), (s_after, truth_after) = before.graded(backend), after.graded(backend)
        assert truth == truth_after  # the same episodes, the same ground truth
        n = len(truth)
        auc = auc_by_pairs(s_before, truth), auc_by_pairs(s_after, truth)
        correct = correct_at(s_before, truth, 0.5), correct_at(s_after, truth, 0.5)
        best = best_by_trying(s_before, truth)[0], best_by_trying(s_after, truth)[0]
        rows = page.table(f"{backend}: all episodes")
        assert rows.row("number", "ROC-AUC") == {"number": "ROC-AUC", "before": f"{auc[0]:.3f}",
                                                 "after": f"{auc[1]:.3f}", "Δ": f"{auc[1] - auc[0]:+.3f}"}
        assert rows.row("number", "accuracy at threshold") == {
            "number": "accuracy at threshold", "before": f"{correct[0] / n:.1%}", "after": f"{correct[1] / n:.1%}",
            "Δ": f"{(correct[1] - correct[0]) / n * 100:+.1f} pp"}
        assert rows.row("number", "episodes")["Δ"] == "+0"
        matched = page.table(f"{backend}: {n} matched episodes")
        assert matched.row("number", "ROC-AUC")["after"] == f"{auc[1]:.3f}"
        assert matched.row("number", "best accuracy")["before"] == f"{best[0] / n:.1%}"
        right = [[(s >= 0.5) == y for s, y in zip(scores, truth, strict=True)] for scores in (s_before, s_after)]
        facts = page.table(f"{backend}: episode by episode")
        assert facts.row("fact", "episodes in both logs")["value"] == str(len(EPISODES) + 1)
        assert facts.row("fact", "verdicts fixed (wrong before, right after)")["value"] == str(
            sum(not b and a for b, a in zip(*right, strict=True)))
        assert facts.row("fact", "verdicts broken (right before, wrong after)")["value"] == str(
            sum(b and not a for b, a in zip(*right, strict=True)))
        change = sum(abs(a - b) for a, b in zip(s_after, s_before, strict=True)) / n
        assert facts.row("fact", "mean |score change|")["value"] == f"{change:.3f}"
        for label, log, value in (("before", before, auc[0]), ("after", after, auc[1])):
            summary = page.table(f"Summary — {label}: {log.audit.name}")
            assert summary.row("backend", backend)["ROC-AUC"] == f"{value:.3f}"
    with Image.open(out / "roc.png") as image:  # one ROC figure, both logs
        description = image.text["Description"]
    assert "qwen2_5_vl_vllm before AUC" in description and "PRIMO-R1 after AUC" in description
    assert "before log, PRIMO-R1: 4.7% of episodes" in page.alert and "after log, PRIMO-R1" in page.alert
