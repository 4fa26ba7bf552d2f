"""The report's cascade section on a hand-made log of cascade episodes (every way an episode goes
on or stops: band, disagree, audit; sure, budget, deadline, the last stage answered): each stage's
escalations by why, the audit's disagreement rate and the stage's own AUC against env_success,
against a computation here; lines of other backends and failed lines are not cascade episodes."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("matplotlib")

from tests.reports.expected import auc_by_pairs  # noqa: E402
from tests.reports.pages import read_page  # noqa: E402
from tests.reports.test_quality_numbers import line, write_log  # noqa: E402
from tests.reports.test_quality_report import run_report  # noqa: E402

THRESHOLD = 0.6  # the lines carry it; the report's own --success-threshold (0.5) must not decide the audit


def stage(backend: str, score: float, went_on: str | None, completion: int = 1) -> dict:
    return {"backend": backend, "score": score, "raw_score": score, "attempts": 1, "seconds": 0.01,
            "usage": {"prompt_tokens": 100, "completion_tokens": completion}, "went_on": went_on}


def cascade_line(stages: list[dict], stopped: str | None, success: bool | None, n: int) -> dict:
    record = line(stages[-1]["score"], success, backend="cheap_first", episode_id=f"c{n}")
    return {**record, "cascade": {"stages": stages, "threshold": THRESHOLD}, "final_stage": stages[-1]["backend"],
            "stopped": stopped}


def episodes() -> tuple[list[dict], dict]:
    rng = random.Random(3)
    records, expected = [], {"judged": 0, "why": {"band": 0, "disagree": 0, "audit": 0}, "audits": 0, "crossed": 0,
                             "cheap": ([], []), "reason": ([], []), "stopped": {}}
    for n in range(80):
        success = rng.random() < 0.5
        cheap = round(rng.random(), 3)
        reason = round(min(1.0, max(0.0, (0.8 if success else 0.2) + rng.uniform(-0.3, 0.3))), 3)
        kind = rng.choice(["sure", "band", "audit", "disagree", "budget", "deadline"])
        truth = None if n % 7 == 3 else success
        if kind in ("sure", "budget"):
            stages, stopped = [stage("p_done", cheap, None)], kind
        elif kind == "deadline":
            stages, stopped = [stage("p_done", cheap, "band")], "deadline"  # went on, the next stage did not run
        else:
            stages, stopped = [stage("p_done", cheap, kind), stage("reason", reason, None, 40 + n)], None
        expected["judged"] += 1
        if stages[0]["went_on"]:
            expected["why"][stages[0]["went_on"]] += 1
        if kind == "audit":
            expected["audits"] += 1
            expected["crossed"] += (cheap >= THRESHOLD) != (reason >= THRESHOLD)
        expected["stopped"][stopped or "none"] = expected["stopped"].get(stopped or "none", 0) + 1
        if truth is not None:
            for index, name in enumerate(("cheap", "reason")):
                if index < len(stages):
                    expected[name][0].append(stages[index]["score"])
                    expected[name][1].append(truth)
        records.append(cascade_line(stages, stopped, truth, n))
    records.append(line(0.9, True, backend="p_done"))  # the stage's backend used directly: not the cascade's
    records.append({**line(None, True, backend="cheap_first"), "cascade": {"stages": [stage("p_done", 0.5, "band")]}})
    return records, expected


def test_the_cascade_section_counts_escalations_audits_and_each_stages_own_auc(tmp_path):
    records, want = episodes()
    assert run_report([str(write_log(tmp_path / "audit.jsonl", records)), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "report.json").read_text())
    cascade = result["logs"][0]["cascades"]["cheap_first"]
    assert cascade["episodes"] == 80 and cascade["stopped"] == dict(sorted(want["stopped"].items()))
    cheap, reason = cascade["stages"]["p_done"], cascade["stages"]["reason"]
    escalated = sum(want["why"].values())
    assert (cheap["ran"], cheap["judged"], cheap["escalated"]) == (80, want["judged"], escalated)
    assert cheap["by_why"] == want["why"] and cheap["escalation_rate"] == pytest.approx(escalated / 80)
    assert (cheap["audits"], cheap["audit_disagreements"]) == (want["audits"], want["crossed"])
    assert cheap["audit_disagreement_rate"] == pytest.approx(want["crossed"] / want["audits"])
    assert cheap["auc"] == pytest.approx(auc_by_pairs(*want["cheap"]))
    assert reason["auc"] == pytest.approx(auc_by_pairs(*want["reason"])) and reason["judged"] == 0
    assert "p_done" not in result["logs"][0]["cascades"]
    row = read_page(tmp_path / "out" / "report.html").table("Cascade stages").row("stage", "p_done")
    assert row["audit disagreement"] == f"{want['crossed']} ({want['crossed'] / want['audits']:.1%})"
    assert row["band / disagree / audit"] == " / ".join(str(want["why"][w]) for w in ("band", "disagree", "audit"))
