"""Dense curves in an audit log (`kind: dense_point`, one line per prefix of a /score/dense curve;
or one score line whose `per_frame` holds a one-call curve, GVL's): each curve's value-order
correlation (VOC, vlm_protocol/agreement.py), per backend and task, apart
for the episodes that succeeded and failed (metadata.env_success).

A successful episode's curve should rise (VOC near 1); a failed one's need not. Streams like
reports/audit.py: a curve's points are held until the last one arrives, then only its VOC is
kept. A curve with a failed point is no curve (the proxy failed it whole) and is counted apart;
at most MAX_OPEN curves wait for points at once (older ones are dropped and counted).
"""

from __future__ import annotations

import html
import math
import statistics
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from reports.plotting import fmt, table
from vlm_protocol.agreement import voc

__all__ = ["DenseLog", "dense_section", "measure_dense"]

MAX_OPEN = 10_000
NO_TASK = "(no task_id)"
OUTCOMES = {True: "success", False: "failure", None: "unknown"}


@dataclass
class _Open:
    backend: str
    task: str
    success: bool | None
    points: int
    seen: dict[int, tuple[int, float]] = field(default_factory=dict)  # point → (frame index, score)
    failed: bool = False


@dataclass
class DenseLog:
    voc: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)  # (backend, task, outcome) → VOCs
    undefined: Counter = field(default_factory=Counter)  # (backend, task): constant curves (no VOC)
    failed_curves: Counter = field(default_factory=Counter)  # backend → curves with a failed point
    dropped: int = 0  # curves never completed within MAX_OPEN
    _open: OrderedDict = field(default_factory=OrderedDict)
    _closed: OrderedDict = field(default_factory=OrderedDict)  # recent closed ids: a point after a failure

    def add(self, record: dict[str, Any]) -> str | None:
        """Fold one dense_point line in; returns why it is malformed, or None."""
        dense, backend = record.get("dense"), record.get("backend")
        if not isinstance(dense, dict) or not isinstance(backend, str):
            return "a dense_point line without its dense {point, points} and backend"
        curve, point, points = dense.get("curve"), dense.get("point"), dense.get("points")
        if curve is None:
            return None  # written before curves had ids: its points cannot be told apart from another's
        if type(point) is not int or type(points) is not int or not 0 <= point < points:
            return "a dense_point line whose point is not within its points"
        metadata = record.get("metadata") if isinstance(record.get("metadata"), dict) else {}
        key = str(curve)
        if key in self._closed:  # a point that finished after its curve failed: the curve is counted
            return None
        if key not in self._open:
            self._open[key] = _entry(backend, metadata, points)
            if len(self._open) > MAX_OPEN:
                self._open.popitem(last=False)
                self.dropped += 1
        entry = self._open[key]
        score, end = record.get("score"), (record.get("asked") or {}).get("prefix_end")
        if "error" in record or type(score) not in (int, float) or not math.isfinite(score):
            entry.failed = True
        else:
            entry.seen[point] = (end if type(end) is int else point, float(score))
        if len(entry.seen) + entry.failed >= entry.points or entry.failed:
            self._close(key)
        return None

    def add_curve(self, backend: str, metadata: dict[str, Any], scores: list[Any]) -> None:
        """A whole curve from one line (a per-frame answer's values, in time order)."""
        entry = _entry(backend, metadata, len(scores))
        for point, score in enumerate(scores):
            if type(score) not in (int, float) or not math.isfinite(score):
                entry.failed = True
            else:
                entry.seen[point] = (point, float(score))
        self._measure(entry)

    def _close(self, key: str) -> None:
        self._closed[key] = None
        if len(self._closed) > MAX_OPEN:
            self._closed.popitem(last=False)
        self._measure(self._open.pop(key))

    def _measure(self, entry: _Open) -> None:
        if entry.failed:
            self.failed_curves[entry.backend] += 1
            return
        scores = [score for _, score in sorted(entry.seen.values())]  # in frame order
        value = voc(scores)
        if value is None:
            self.undefined[(entry.backend, entry.task)] += 1
        else:
            self.voc.setdefault((entry.backend, entry.task, OUTCOMES[entry.success]), []).append(value)


def _entry(backend: str, metadata: dict[str, Any], points: int) -> _Open:
    success = metadata.get("env_success")
    return _Open(backend, NO_TASK if metadata.get("task_id") is None else str(metadata["task_id"]),
                 success if isinstance(success, bool) else None, points)


def _numbers(values: list[float]) -> dict[str, Any]:
    return {"curves": len(values), "mean": statistics.fmean(values) if values else None,
            "median": statistics.median(values) if values else None,
            "rising": sum(1 for v in values if v > 0) / len(values) if values else None}


def measure_dense(log: DenseLog) -> dict[str, Any]:
    """Per backend: VOC over every curve and by outcome, then per task the same."""
    out: dict[str, Any] = {}
    for backend in sorted({b for b, _, _ in log.voc} | {b for b, _ in log.undefined} | set(log.failed_curves)):
        tasks = sorted({t for b, t, _ in log.voc if b == backend} | {t for b, t in log.undefined if b == backend})
        out[backend] = {**_by_outcome(log, backend, None), "failed_curves": log.failed_curves.get(backend, 0),
                        "tasks": {task: _by_outcome(log, backend, task) for task in tasks}}
    return out


def _by_outcome(log: DenseLog, backend: str, task: str | None) -> dict[str, Any]:
    """One backend's (one task's, or all its tasks') VOC numbers: all curves, then per outcome."""
    picked = {outcome: [v for (b, t, o), values in log.voc.items()
                        if b == backend and (task is None or t == task) and o == outcome for v in values]
              for outcome in OUTCOMES.values()}
    return {"all": _numbers([v for values in picked.values() for v in values]),
            **{outcome: _numbers(values) for outcome, values in picked.items() if values},
            "constant": sum(n for (b, t), n in log.undefined.items() if b == backend and (task is None or t == task))}


DENSE_KEYS = ("backend", "task_id", "outcome", "curves", "mean VOC", "median VOC", "rising", "constant")


def dense_section(dense: dict[str, Any], who: str = "") -> str:
    """Per backend (then task) and outcome: each dense curve's VOC, averaged."""
    head = f"<h2>Dense curves{html.escape(who)}</h2>"
    if not dense:
        return head + "<p>No dense curve (POST /score/dense) in this log.</p>"
    rows = []
    for backend, numbers in dense.items():
        scopes = [("all tasks", numbers)] if len(numbers["tasks"]) > 1 else []
        for task, scope in [*scopes, *numbers["tasks"].items()]:
            for outcome in ("all", *OUTCOMES.values()):
                if outcome not in scope or (outcome != "all" and not scope[outcome]["curves"]):
                    continue
                n = scope[outcome]
                rows.append({"backend": backend, "task_id": task, "outcome": outcome, "curves": fmt(n["curves"], "int"),
                             "mean VOC": fmt(n["mean"], "3"), "median VOC": fmt(n["median"], "3"),
                             "rising": fmt(n["rising"], "%"),
                             "constant": fmt(scope["constant"], "int") if outcome == "all" else ""})
    failed = sum(numbers["failed_curves"] for numbers in dense.values())
    return (head + "<p>VOC (value-order correlation, GVL): the rank correlation of a curve's scores with its frame "
            "order, from −1 to 1. A successful episode's curve should rise (VOC near 1); a curve that ignores "
            "time scores near 0. <b>Rising</b>: the share of curves with VOC &gt; 0; <b>constant</b>: curves "
            "with one value throughout (no VOC)." + (f" {failed:,} curve(s) failed at a point and are left out."
                                                    if failed else "") + "</p>"
            + table(DENSE_KEYS, rows, caption=f"Dense curves{who}"))
