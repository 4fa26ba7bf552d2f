"""The live monitor's own audit lines, read apart from episodes: `kind: quality_alarm` (one per
transition of a (run, backend, task)'s alarm) and `kind: probe` (an episode scored again with its
frames reversed or shuffled, or another task's instruction). Neither is an episode's score.

Streams like reports/audit.py: alarm transitions are kept (they are rare: the proxy's hysteresis
stops a key from flapping), probes only as sums per (backend, task, probe kind). The pure
computations are here too: alarm periods from the transitions, a probe group's numbers.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from reports.by_task import task_order
from vlm_protocol.agreement import ALARM, OK, PROBE_KINDS, RESET  # the monitor's words, defined once

__all__ = ["PROBE_KINDS", "AlarmLog", "ProbeGroup", "ProbeLog", "Transition", "alarm_periods", "measure_probes",
           "probe_numbers"]

NO_TASK = "(no task_id)"
OTHER_TASKS = "(other tasks)"
MAX_TASKS_PER_BACKEND = 200  # as for scored episodes: more task ids than this are pooled


def _number(value: Any) -> float | None:
    kind = type(value)  # a bool is not a number here
    if kind is float:
        return value if math.isfinite(value) else None
    return float(value) if kind is int else None


def _task(task_id: Any) -> str:
    return NO_TASK if task_id is None else str(task_id)


# -- alarms --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Transition:
    ts: float
    line: int
    status: str  # "alarm" (raised), "ok" (cleared) or "reset" (the proxy stopped in alarm)
    reason: str | None
    numbers: dict[str, Any]
    episodes_seen: int | None


@dataclass
class AlarmLog:
    """Every alarm transition, per (run, backend, task_id); run None = the episodes named no run."""

    transitions: dict[tuple[str | None, str, str], list[Transition]] = field(default_factory=dict)

    def add(self, record: dict[str, Any], line: int) -> str | None:
        """Fold one `kind: quality_alarm` line in; returns why it is malformed, or None."""
        status, ts = record.get("status"), _number(record.get("ts"))
        if status not in (ALARM, OK, RESET) or ts is None:
            return "a quality_alarm line without a status (alarm / ok / reset) and a ts"
        run = record.get("run")
        key = (None if run is None else str(run), str(record.get("backend") or "(no backend)"),
               _task(record.get("task_id")))
        numbers = record.get("numbers") if isinstance(record.get("numbers"), dict) else {}
        reason = record.get("reason")
        seen = record.get("episodes_seen")
        self.transitions.setdefault(key, []).append(Transition(
            ts, line, status, None if reason is None else str(reason), numbers,
            seen if type(seen) is int else None))
        return None


def alarm_periods(alarms: AlarmLog, first_ts: float | None, last_ts: float | None) -> list[dict[str, Any]]:
    """Each stretch a key spent in alarm: raised at a transition to alarm, ended by the next one to ok.
    A raise while already in alarm (the proxy restarted, say) continues the period and is counted; a
    clear with no raise before it had its raise outside the log (a rotated-away file): raised_ts None.
    A period still open at the end runs to the log's last line (still_in_alarm). from_ts .. to_ts is
    what is known of it (from the log's first line or the key's previous clear when the raise is not
    in the log), duration_s their difference. Keys in (run, backend, task) order."""
    periods = []
    for key in sorted(alarms.transitions, key=lambda k: (k[0] is not None, k[0] or "", k[1], k[2])):
        run, backend, task = key
        current: dict[str, Any] | None = None
        since = first_ts  # the earliest an alarm of this key not raised in the log can have been raised
        for t in sorted(alarms.transitions[key], key=lambda t: (t.ts, t.line)):  # rotated files may interleave
            if t.status == RESET and current is None:  # the proxy stopped, no alarm open here: nothing ended
                continue
            if t.status == ALARM and current is not None:
                current["repeated_raises"] += 1
                continue
            if current is None:  # a raise, or a clear whose raise is not in the log
                raised = t if t.status == ALARM else None
                current = {"run": run, "backend": backend, "task_id": task,
                           "raised_ts": raised.ts if raised else None, "raised_line": raised.line if raised else None,
                           "cleared_ts": None, "cleared_line": None, "still_in_alarm": True,
                           "from_ts": raised.ts if raised else since, "to_ts": last_ts,
                           "reason": raised.reason if raised else None, "numbers": raised.numbers if raised else None,
                           "episodes_seen": raised.episodes_seen if raised else None, "repeated_raises": 0,
                           "cleared_numbers": None, "ended_by": None}
                periods.append(current)
            if t.status in (OK, RESET):  # cleared, or the proxy stopped (a restart opens a new period)
                current.update(cleared_ts=t.ts, cleared_line=t.line, still_in_alarm=False, to_ts=t.ts,
                               cleared_numbers=t.numbers, ended_by="clear" if t.status == OK else "proxy stopped")
                current, since = None, t.ts
    for period in periods:
        start, end = period["from_ts"], period["to_ts"]
        period["duration_s"] = None if start is None or end is None else end - start
    return periods


# -- probes --------------------------------------------------------------------------------------
@dataclass
class ProbeGroup:
    """One (backend, task_id, probe kind)'s probes, as sums. margin = original - probe score."""

    n: int = 0
    margin_sum: float = 0.0
    inversions: int = 0  # the probe scored at least the original: the model did not notice
    original_sum: float = 0.0
    probe_sum: float = 0.0
    errors: Counter = field(default_factory=Counter)  # a probe that could not be scored, by code

    def absorb(self, other: ProbeGroup) -> None:
        self.n += other.n
        self.margin_sum += other.margin_sum
        self.inversions += other.inversions
        self.original_sum += other.original_sum
        self.probe_sum += other.probe_sum
        self.errors.update(other.errors)


@dataclass
class ProbeLog:
    groups: dict[tuple[str, str, str], ProbeGroup] = field(default_factory=dict)

    def add(self, record: dict[str, Any]) -> str | None:
        """Fold one `kind: probe` line in; returns why it is malformed, or None. The margin is
        recomputed from the two scores, so margins and inversions always agree."""
        kind = record.get("probe")
        if not isinstance(kind, str) or not kind:
            return "a probe line without a probe kind"
        error = record.get("error")
        original, probe = _number(record.get("original_score")), _number(record.get("probe_score"))
        valid = original is not None and probe is not None and 0.0 <= original <= 1.0 and 0.0 <= probe <= 1.0
        if not isinstance(error, dict) and not valid:
            return "a probe line with neither original_score and probe_score in [0, 1] nor an error"
        group = self._group(str(record.get("backend") or "(no backend)"), record.get("task_id"), kind)
        if isinstance(error, dict):
            group.errors[str(error.get("code") or "unknown_error")] += 1
            return None
        group.n += 1
        group.margin_sum += original - probe
        group.inversions += probe >= original
        group.original_sum += original
        group.probe_sum += probe
        return None

    def _group(self, backend: str, task_id: Any, kind: str) -> ProbeGroup:
        key = (backend, _task(task_id), kind)
        if key not in self.groups:
            tasks = {t for b, t, _ in self.groups if b == backend}
            if key[1] not in tasks and len(tasks) >= MAX_TASKS_PER_BACKEND:
                key = (backend, OTHER_TASKS, kind)
        return self.groups.setdefault(key, ProbeGroup())


def probe_numbers(group: ProbeGroup) -> dict[str, Any]:
    """The numbers of the live monitor's probe window (proxy/quality/window.py), over the whole log."""
    n = group.n
    return {"n": n, "mean_margin": group.margin_sum / n if n else None, "inversions": group.inversions,
            "inversion_rate": group.inversions / n if n else None,
            "mean_original_score": group.original_sum / n if n else None,
            "mean_probe_score": group.probe_sum / n if n else None,
            "errors": sum(group.errors.values()), "errors_by_code": dict(sorted(group.errors.items()))}


def _kind_order(kind: str) -> tuple[int, str]:
    return (PROBE_KINDS.index(kind) if kind in PROBE_KINDS else len(PROBE_KINDS), kind)


def measure_probes(probes: ProbeLog) -> dict[str, dict[str, Any]]:
    """backend -> {"all": {kind: numbers}, "tasks": {task: {kind: numbers}}}: what report.json holds."""
    measured: dict[str, dict[str, Any]] = {}
    for backend in sorted({b for b, _, _ in probes.groups}):
        keys = [k for k in probes.groups if k[0] == backend]
        pooled = {kind: ProbeGroup() for _, _, kind in keys}
        tasks: dict[str, dict[str, Any]] = {}
        for _, task, kind in sorted(keys, key=lambda k: (task_order(k[1]), _kind_order(k[2]))):
            group = probes.groups[(backend, task, kind)]
            pooled[kind].absorb(group)
            tasks.setdefault(task, {})[kind] = probe_numbers(group)
        measured[backend] = {"all": {kind: probe_numbers(pooled[kind]) for kind in sorted(pooled, key=_kind_order)},
                             "tasks": tasks}
    return measured
