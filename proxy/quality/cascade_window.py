"""The live monitor's view of cascades: per (run, cascade, task) a rolling window of its episodes,
and per stage that can go on, the share of the episodes reaching it that went on (the escalation
rate, by why: band, disagree, audit) and the audit's disagreement rate: of the audited episodes
whose next stage ran, the share where this stage's score lies across the cascade's threshold from
the final stage's (the cheap stage's error rate where it was sure, measured without bias).

Every cascade episode counts, with or without env_success (the rates need no ground truth); the
stages' own agreement with env_success is the monitor's ordinary window under `<cascade>/<stage>`.
Keys are bounded by quality.max_keys (the least recently seen is forgotten, its series with it).
Pure bookkeeping on the event loop, like window.py.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict, deque
from typing import Any

__all__ = ["CascadeWatch", "StageOutcome"]

# (stage backend, why it went on or None, audit outcome: True disagreed, False agreed, None not audited)
StageOutcome = tuple[str, str | None, bool | None]
WHYS = ("band", "disagree", "audit")


def stage_outcomes(stages: list[Any], threshold: float, stopped: str | None) -> list[StageOutcome]:
    """What an episode says about each stage that could go on: every stage that ran but the final
    one, and the final one too when the episode stopped early (sure, budget or deadline).
    `stages`: objects or dicts with backend, score, went_on."""
    def get(stage: Any, key: str) -> Any:
        return stage[key] if isinstance(stage, dict) else getattr(stage, key)

    final = get(stages[-1], "score")
    judged = stages if stopped is not None else stages[:-1]
    out = []
    for index, stage in enumerate(judged):
        why = get(stage, "went_on")
        audited = None
        if why == "audit" and index < len(stages) - 1:  # the next stage ran: its answer is the reference
            audited = (get(stage, "score") >= threshold) != (final >= threshold)
        out.append((get(stage, "backend"), why, audited))
    return out


def window_numbers(entries: list[list[StageOutcome]]) -> dict[str, dict[str, Any]]:
    """stage → episodes that reached it, went on (by why), the escalation rate, audits, their
    disagreements and the disagreement rate (None where undefined)."""
    out: dict[str, dict[str, Any]] = {}
    for episode in entries:
        for backend, why, audited in episode:
            n = out.setdefault(backend, {"episodes": 0, "escalated": 0, "by_why": dict.fromkeys(WHYS, 0),
                                         "audits": 0, "audit_disagreements": 0})
            n["episodes"] += 1
            if why is not None:
                n["escalated"] += 1
                n["by_why"][why] = n["by_why"].get(why, 0) + 1
            if audited is not None:
                n["audits"] += 1
                n["audit_disagreements"] += audited
    for n in out.values():
        n["escalation_rate"] = n["escalated"] / n["episodes"]
        n["audit_disagreement_rate"] = n["audit_disagreements"] / n["audits"] if n["audits"] else None
    return out


class _Window:
    """One key's last `size` episodes and their running sums per stage (added and taken off as an
    episode enters and leaves, so an episode costs its own stages, not the window's)."""

    def __init__(self, size: int) -> None:
        self.entries: deque[list[StageOutcome]] = deque()
        self.size = size
        self.sums: dict[str, list[int]] = {}  # stage → [episodes, escalated, band, disagree, audit, audits, crossed]

    def add(self, outcomes: list[StageOutcome]) -> None:
        self.entries.append(outcomes)
        self._count(outcomes, 1)
        if len(self.entries) > self.size:
            self._count(self.entries.popleft(), -1)

    def _count(self, outcomes: list[StageOutcome], sign: int) -> None:
        for backend, why, audited in outcomes:
            sums = self.sums.setdefault(backend, [0] * 7)
            sums[0] += sign
            if why is not None:
                sums[1] += sign
                if why in WHYS:
                    sums[2 + WHYS.index(why)] += sign
            if audited is not None:
                sums[5] += sign
                sums[6] += sign * audited

    def numbers(self) -> dict[str, dict[str, Any]]:
        """The same as window_numbers(list(self.entries)), from the running sums."""
        out = {}
        for backend, (episodes, escalated, band, disagree, audit, audits, crossed) in self.sums.items():
            if episodes:
                out[backend] = {"episodes": episodes, "escalated": escalated,
                                "by_why": {"band": band, "disagree": disagree, "audit": audit},
                                "audits": audits, "audit_disagreements": crossed,
                                "escalation_rate": escalated / episodes,
                                "audit_disagreement_rate": crossed / audits if audits else None}
        return out


class CascadeWatch:
    def __init__(self, window: int, max_keys: int, metrics: Any) -> None:
        self.size, self.max_keys, self.metrics = window, max_keys, metrics
        self.windows: OrderedDict[tuple[str | None, str, str], _Window] = OrderedDict()
        self.numbers: dict[tuple[str | None, str, str], dict[str, dict[str, Any]]] = {}

    def observe(self, key: tuple[str | None, str, str], outcomes: list[StageOutcome]) -> dict[str, dict[str, Any]]:
        window = self.windows.pop(key, None)
        if window is None:
            window = _Window(self.size)
            while len(self.windows) >= self.max_keys:
                old, _ = self.windows.popitem(last=False)
                self._forget(old)
        self.windows[key] = window  # the most recently seen last: eviction takes the idlest first
        window.add(outcomes)
        numbers = self.numbers[key] = window.numbers()
        labels = (key[0] or "", key[1], key[2])
        for stage, n in numbers.items():
            self.metrics.cascade_escalation_rate.labels(*labels, stage).set(n["escalation_rate"])
            rate = n["audit_disagreement_rate"]
            self.metrics.cascade_audit_disagreement_rate.labels(*labels, stage).set(math.nan if rate is None else rate)
            self.metrics.cascade_window_audits.labels(*labels, stage).set(n["audits"])
        return numbers

    def _forget(self, key: tuple[str | None, str, str]) -> None:
        labels = (key[0] or "", key[1], key[2])
        for stage in self.numbers.pop(key, {}):
            for gauge in (self.metrics.cascade_escalation_rate, self.metrics.cascade_audit_disagreement_rate,
                          self.metrics.cascade_window_audits):
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels, stage)

    def snapshot(self) -> list[dict[str, Any]]:
        """GET /quality's `cascades`: each key's window, per stage that can go on."""
        return [{"key": {"run": run, "backend": cascade, "task_id": task}, "episodes": len(window.entries),
                 "stages": self.numbers.get((run, cascade, task), {})}
                for (run, cascade, task), window in self.windows.items()]
