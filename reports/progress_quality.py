"""Progress lines in the audit log (`"kind": "progress"`, one per POST /progress/batch item, run D):
read apart from /score episodes, measured per backend and task, and shown in their own section.

A progress line is not a score: a success is 1 by definition and a failure's progress is relative
to the other failures of its task in the same request (docs/progress.md), so there is no
agreement with env_success to measure. What matters is the distribution of the failures'
progress per task (does it spread, or does every failure sit near 0.5?) and how many failures had
no reference at all (paid the native reward instead). Streams like reports/audit.py: numbers only.
"""

from __future__ import annotations

import html
import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from reports.by_task import ByTask
from reports.plotting import fmt, table
from vlm_protocol.progress import OUTCOMES

__all__ = ["PROGRESS_QUANTILES", "ProgressGroup", "ProgressLog", "progress_alerts", "progress_numbers",
           "progress_section"]

PROGRESS_QUANTILES = (10, 25, 50, 75, 90)
NO_TASK = "(no task_id)"
OTHER_TASKS = "(other tasks)"
MAX_TASKS_PER_BACKEND = 200  # as for scored episodes: more task ids than this are pooled
ERROR_ALERT = 0.01
# Failures alone in their normalisation (the only failure of their task in the request) get 0.5
# whatever their distance: above this share, the progress reward carries little information.
ALONE_ALERT = 0.5


@dataclass
class ProgressGroup:
    """One (backend, task_id)'s progress lines, as numbers."""

    lines: int = 0
    successes: int = 0
    no_reference: int = 0  # failures without a reference: no progress, the native reward
    alone: int = 0  # rated failures normalised over themselves only (progress 0.5 by construction)
    progress: array = field(default_factory=lambda: array("d"))  # each rated failure's progress
    errors: Counter = field(default_factory=Counter)  # code -> items that failed
    latency_ms: array = field(default_factory=lambda: array("d"))

    def absorb(self, other: ProgressGroup) -> None:
        self.lines += other.lines
        self.successes += other.successes
        self.no_reference += other.no_reference
        self.alone += other.alone
        self.progress.extend(other.progress)
        self.errors.update(other.errors)
        self.latency_ms.extend(other.latency_ms)


@dataclass
class ProgressLog(ByTask[ProgressGroup]):
    groups: dict[tuple[str, str], ProgressGroup] = field(default_factory=dict)

    def new_group(self) -> ProgressGroup:
        return ProgressGroup()

    def add(self, record: dict[str, Any]) -> str | None:
        """Fold one `kind: progress` line in; returns why it is malformed, or None."""
        error, outcome, progress = record.get("error"), record.get("outcome"), record.get("progress")
        if not isinstance(error, dict):
            why = _invalid(outcome, progress)
            if why:
                return f"a progress line with {why}"
        metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
        group = self._group(str(record.get("backend") or "(no backend)"), metadata.get("task_id"))
        group.lines += 1
        if isinstance(error, dict):
            group.errors[str(error.get("code") or "unknown_error")] += 1
            return None
        if outcome == "success":
            group.successes += 1
        elif outcome == "no_reference":
            group.no_reference += 1
        else:
            group.progress.append(float(progress))
            reference = record.get("reference") if isinstance(record.get("reference"), dict) else {}
            group.alone += reference.get("failures") == 1
        timings = record.get("timings_ms")
        total = timings.get("total") if isinstance(timings, dict) else None
        if type(total) in (int, float) and math.isfinite(total):
            group.latency_ms.append(float(total))
        return None

    def _group(self, backend: str, task_id: Any) -> ProgressGroup:
        key = (backend, NO_TASK if task_id is None else str(task_id))
        if key not in self.groups and sum(1 for b, _ in self.groups if b == backend) >= MAX_TASKS_PER_BACKEND:
            key = (backend, OTHER_TASKS)
        return self.groups.setdefault(key, ProgressGroup())


def _invalid(outcome: Any, progress: Any) -> str | None:
    if outcome not in OUTCOMES:
        return f"neither an outcome ({', '.join(OUTCOMES)}) nor an error"
    if outcome == "no_reference":
        return None if progress is None else "outcome no_reference and a progress"
    if type(progress) not in (int, float) or not math.isfinite(progress) or not 0.0 <= progress <= 1.0:
        return f"outcome {outcome} without a progress in [0, 1]"
    return None


def _percentiles(values: Any, quantiles: tuple[int, ...]) -> dict[int, float | None]:
    """Linear-interpolated, as reports.quality's (which imports reports.audit, which imports this)."""
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return dict.fromkeys(quantiles)
    return {q: float(x) for q, x in zip(quantiles, np.percentile(v, quantiles), strict=True)}


def progress_numbers(group: ProgressGroup) -> dict[str, Any]:
    """Every number the progress section shows for one backend or (backend, task)."""
    values = np.frombuffer(group.progress, dtype=np.float64) if len(group.progress) else np.empty(0)
    failures = len(values) + group.no_reference
    errors = sum(group.errors.values())
    numbers: dict[str, Any] = {
        "lines": group.lines, "successes": group.successes, "failures": failures, "rated": len(values),
        "no_reference": group.no_reference, "no_reference_rate": group.no_reference / failures if failures else None,
        "alone": group.alone, "alone_rate": group.alone / len(values) if len(values) else None,
        "progress_mean": float(values.mean()) if len(values) else None,
        "progress_std": float(values.std()) if len(values) else None,
        "errors": errors, "error_rate": errors / group.lines if group.lines else None,
        "errors_by_code": dict(sorted(group.errors.items())),
    }
    numbers.update({f"progress_p{q}": v for q, v in _percentiles(values, PROGRESS_QUANTILES).items()})
    numbers.update({f"latency_p{q}": v for q, v in _percentiles(group.latency_ms, (50, 99)).items()})
    return numbers


def measure_progress(progress: ProgressLog) -> dict[str, dict[str, Any]]:
    """backend -> {"all": numbers, "tasks": {task: numbers}}: what report.json holds."""
    return {backend: {"all": progress_numbers(progress.backend_group(backend)),
                      "tasks": {task: progress_numbers(progress.groups[(backend, task)])
                                for task in progress.tasks(backend)}}
            for backend in progress.backends()}


def progress_alerts(measured: dict[str, dict[str, Any]], who: str = "") -> list[str]:
    lines = []
    for backend, numbers in measured.items():
        n = numbers["all"]
        if n["error_rate"] is not None and n["error_rate"] >= ERROR_ALERT:
            lines.append(f"{who}{backend} (progress): {fmt(n['error_rate'], '%')} of items ({n['errors']} of "
                         f"{n['lines']}) failed: " + ", ".join(f"{c} ×{k}" for c, k in n["errors_by_code"].items()))
        if n["alone_rate"] is not None and n["alone_rate"] > ALONE_ALERT:
            lines.append(f"{who}{backend} (progress): {fmt(n['alone_rate'], '%')} of rated failures were the only "
                         "failure of their task in their request, so SRPO's min-max normalisation gave them 0.5 "
                         "whatever their distance: send more episodes per request")
        if n["failures"] and not n["rated"]:
            lines.append(f"{who}{backend} (progress): none of its {n['failures']} failures had a reference, so "
                         "every one was paid the native reward: is the proxy's reference_store on?")
    return lines


def _row(n: dict[str, Any]) -> dict[str, str]:
    return {
        "items": fmt(n["lines"], "int"), "successes": fmt(n["successes"], "int"),
        "failures (rated / no reference)": f"{n['failures']:,} ({n['rated']:,} / {n['no_reference']:,})",
        "no reference": fmt(n["no_reference_rate"], "%"),
        "alone (0.5 by construction)": fmt(n["alone_rate"], "%"),
        "progress mean ± std": "—" if n["progress_mean"] is None else
        f"{n['progress_mean']:.3f} ± {n['progress_std']:.3f}",
        "progress p10 / p25 / p50 / p75 / p90": " / ".join(fmt(n[f"progress_p{q}"], "3") for q in PROGRESS_QUANTILES),
        "errors": f"{n['errors']:,} ({fmt(n['error_rate'], '%')})",
        "latency ms p50 / p99": f"{fmt(n['latency_p50'], 'int')} / {fmt(n['latency_p99'], 'int')}",
    }


KEYS = ("items", "successes", "failures (rated / no reference)", "no reference", "alone (0.5 by construction)",
        "progress mean ± std",
        "progress p10 / p25 / p50 / p75 / p90", "errors", "latency ms p50 / p99")


def progress_section(measured: dict[str, dict[str, Any]], label: str = "") -> str:
    """The page's section for one log's progress lines; empty when it has none."""
    if not measured:
        return ""
    who = f" — {label}" if label else ""
    parts = [f"<h2>Progress (POST /progress/batch){html.escape(who)}</h2>",
             "<p>Kept apart from scored episodes. A success's progress is 1 by definition; a failure's is "
             "relative to the other failures of its task in the same request (docs/progress.md), so only the "
             "failures' distribution is shown. A failure without a reference has no progress: the RLinf hook "
             "paid it the native reward.</p>",
             table(("backend", *KEYS), ({"backend": b, **_row(n["all"])} for b, n in measured.items()),
                   caption=f"Progress per backend{who}")]
    for backend, numbers in measured.items():
        parts.append(table(("task_id", *KEYS), ({"task_id": t, **_row(n)} for t, n in numbers["tasks"].items()),
                           caption=f"Progress of failures per task — {backend}{who}"))
    return "".join(parts)
