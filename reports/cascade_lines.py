"""Cascades in an audit log: a cascade's score line carries `cascade: {stages: [...], threshold}`
(every stage that ran: backend, score, usage, seconds, went_on), `final_stage` and `stopped`. Per
cascade and stage, over the whole log, the numbers the live monitor keeps over its window
(proxy/quality/cascade_window.py), by the same rules:

    escalation rate   of the episodes that reached a stage able to go on (every stage that ran but
                      the final one, and the final one too when the episode stopped early), the
                      share that went on, by why (band, disagree, audit)
    audit             of the audited episodes whose next stage ran, the share where this stage's
                      score lies across the cascade's threshold from the final stage's
    own AUC           the stage's score against metadata.env_success, on every episode it scored

and per cascade why its episodes stopped (sure, budget, deadline; none: the last stage answered).
Streams like reports/audit.py: sums and one score array per stage, never the records.
"""

from __future__ import annotations

import html
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from reports.plotting import fmt, table
from vlm_protocol.agreement import roc_auc

__all__ = ["CascadeLog", "cascade_section", "measure_cascades"]

WHYS = ("band", "disagree", "audit")
MAX_STAGES = 32  # stage names per cascade kept apart (a cascade has a handful)


@dataclass
class _Stage:
    ran: int = 0
    judged: int = 0  # reached it able to go on
    went_on: Counter = field(default_factory=Counter)
    audits: int = 0
    audit_disagreements: int = 0
    scores: array = field(default_factory=lambda: array("d"))  # with env_success only
    truth: array = field(default_factory=lambda: array("b"))
    prompt_tokens: float = 0.0
    completion_tokens: float = 0.0
    seconds: float = 0.0


@dataclass
class CascadeLog:
    stages: dict[str, dict[str, _Stage]] = field(default_factory=dict)  # cascade → stage backend → sums
    episodes: Counter = field(default_factory=Counter)  # cascade → episodes
    stopped: dict[str, Counter] = field(default_factory=dict)  # cascade → why it stopped (none: the last answered)

    def add(self, record: dict[str, Any], threshold: float = 0.5) -> None:
        """Fold one scored episode line in (lines without a usable `cascade` field are skipped). The
        line's own cascade.threshold decides the audit; `threshold` only where a line has none."""
        cascade = record.get("cascade")
        stages = cascade.get("stages") if isinstance(cascade, dict) else None
        if not isinstance(stages, list) or not stages or not all(
                isinstance(s, dict) and isinstance(s.get("backend"), str) and _number(s.get("score")) is not None
                for s in stages):
            return
        name = str(record.get("backend") or "(no backend)")
        cut = _number(cascade.get("threshold"))
        cut = threshold if cut is None else cut
        stopped = record.get("stopped")
        self.episodes[name] += 1
        self.stopped.setdefault(name, Counter())[str(stopped) if stopped else "none"] += 1
        metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
        success = metadata.get("env_success")
        final = _number(stages[-1]["score"])
        by_stage = self.stages.setdefault(name, {})
        for index, stage in enumerate(stages):
            if stage["backend"] not in by_stage and len(by_stage) >= MAX_STAGES:
                continue
            sums = by_stage.setdefault(stage["backend"], _Stage())
            score = _number(stage["score"])
            sums.ran += 1
            usage = stage.get("usage") if isinstance(stage.get("usage"), dict) else {}
            sums.prompt_tokens += _number(usage.get("prompt_tokens")) or 0.0
            sums.completion_tokens += _number(usage.get("completion_tokens")) or 0.0
            sums.seconds += _number(stage.get("seconds")) or 0.0
            if isinstance(success, bool):
                sums.scores.append(score)
                sums.truth.append(success)
            if index == len(stages) - 1 and not stopped:
                continue  # the last stage answered: it could not go on
            sums.judged += 1
            why = stage.get("went_on")
            if why:
                sums.went_on[str(why)] += 1
            if why == "audit" and index < len(stages) - 1:
                sums.audits += 1
                sums.audit_disagreements += (score >= cut) != (final >= cut)


def _number(value: Any) -> float | None:
    kind = type(value)  # a bool is not a number here
    if kind is float:
        return value if math.isfinite(value) else None
    return float(value) if kind is int else None


def measure_cascades(log: CascadeLog) -> dict[str, dict[str, Any]]:
    """cascade → {"episodes", "stopped": {why: count}, "stages": {backend: numbers}}: report.json's."""
    out = {}
    for name, stages in sorted(log.stages.items()):
        numbers = {}
        for backend, s in stages.items():
            escalated = sum(s.went_on.values())
            numbers[backend] = {
                "ran": s.ran, "judged": s.judged, "escalated": escalated,
                "escalation_rate": escalated / s.judged if s.judged else None,
                "by_why": {why: s.went_on.get(why, 0) for why in sorted({*WHYS, *s.went_on})},
                "audits": s.audits, "audit_disagreements": s.audit_disagreements,
                "audit_disagreement_rate": s.audit_disagreements / s.audits if s.audits else None,
                "with_truth": len(s.scores), "auc": roc_auc(list(s.scores), [bool(t) for t in s.truth]),
                "prompt_tokens_per_run": s.prompt_tokens / s.ran,
                "completion_tokens_per_run": s.completion_tokens / s.ran, "seconds_per_run": s.seconds / s.ran}
        out[name] = {"episodes": log.episodes[name], "stopped": dict(sorted(log.stopped.get(name, {}).items())),
                     "stages": numbers}
    return out


KEYS = ("cascade", "stage", "ran", "escalated", "band / disagree / audit", "audits", "audit disagreement",
        "own AUC (episodes with env_success)", "prompt / completion tokens per run", "s per run")


def cascade_section(cascades: dict[str, dict[str, Any]], who: str = "") -> str:
    """The report's cascade section; empty when the log holds no cascade episode."""
    if not cascades:
        return ""
    rows = []
    for name, c in cascades.items():
        for backend, n in c["stages"].items():
            why = n["by_why"]
            rows.append({"cascade": name, "stage": backend, "ran": fmt(n["ran"], "int"),
                         "escalated": "—" if n["escalation_rate"] is None else
                         f"{n['escalated']} of {n['judged']} ({fmt(n['escalation_rate'], '%')})",
                         "band / disagree / audit": f"{why.get('band', 0)} / {why.get('disagree', 0)} / "
                                                    f"{why.get('audit', 0)}",
                         "audits": fmt(n["audits"], "int"),
                         "audit disagreement": "—" if n["audit_disagreement_rate"] is None else
                         f"{n['audit_disagreements']} ({fmt(n['audit_disagreement_rate'], '%')})",
                         "own AUC (episodes with env_success)": f"{fmt(n['auc'], '3')} ({n['with_truth']})",
                         "prompt / completion tokens per run": f"{n['prompt_tokens_per_run']:.0f} / "
                                                               f"{n['completion_tokens_per_run']:.0f}",
                         "s per run": f"{n['seconds_per_run']:.3g}"})
    stopped = "".join(f"<li><b>{html.escape(name)}</b>: {c['episodes']} episodes; stopped "
                      + ", ".join(f"{html.escape(why)} {count}" for why, count in c["stopped"].items()) + "</li>"
                      for name, c in cascades.items())
    return (f"<h2>Cascades{html.escape(who)}</h2>"
            "<p>Per cascade and stage, over the whole log: the episodes that reached a stage able to go on and "
            "the share that went on (by why); of the audited ones (the stage was sure, the hash sent them on), "
            "the share where the stage lay across the cascade's threshold from the final stage (the cheap "
            "stage's error where it is confident); and each stage's own ROC-AUC against env_success. Why the "
            "episodes stopped (none: the last stage answered; sure; budget; deadline):</p><ul>" + stopped + "</ul>"
            + table(KEYS, rows, caption=f"Cascade stages{who}"))
