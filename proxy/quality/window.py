"""One key's rolling window of (score, success) and its alarm, with hysteresis. Pure: the numbers
are vlm_protocol.agreement's, the same definitions as `vlm-reward-proxy report`."""

from __future__ import annotations

from collections import deque
from typing import Any

from vlm_protocol.agreement import ALARM, OK, UNKNOWN, agreement

__all__ = ["KeyWindow"]


class KeyWindow:
    def __init__(self, size: int) -> None:
        # (score, env_success); score None = the reply did not parse (counted, never a number)
        self.entries: deque[tuple[float | None, bool]] = deque(maxlen=size)
        self.episodes = 0  # ever added
        self.first: dict[str, Any] | None = None  # the numbers of the first full window (drift)
        self.alarmed = False
        self.reason: str | None = None
        self.numbers: dict[str, Any] = {}
        # invariance probes by kind: (original score, probe score), the last `size` of each
        self.probes: dict[str, deque[tuple[float, float]]] = {}

    def add_probe(self, kind: str, original: float, probe: float) -> dict[str, Any]:
        """One probe's outcome; returns that kind's numbers: probes, mean margin (original - probe)
        and inversions (the probe scored at least the original)."""
        kept = self.probes.setdefault(kind, deque(maxlen=self.entries.maxlen))
        kept.append((original, probe))
        return self.probe_numbers()[kind]

    def probe_numbers(self) -> dict[str, dict[str, Any]]:
        out = {}
        for kind, kept in self.probes.items():
            inversions = sum(1 for original, probe in kept if probe >= original)
            out[kind] = {"n": len(kept), "mean_margin": sum(o - p for o, p in kept) / len(kept),
                         "inversions": inversions, "inversion_rate": inversions / len(kept)}
        return out

    def add(self, score: float | None, success: bool, threshold: float) -> dict[str, Any]:
        self.entries.append((score, success))
        self.episodes += 1
        scored = [(s, y) for s, y in self.entries if s is not None]
        self.numbers = {**agreement([s for s, _ in scored], [y for _, y in scored], threshold),
                        "episodes": len(self.entries), "parse_failures": len(self.entries) - len(scored)}
        if self.first is None and len(self.entries) == self.entries.maxlen:
            self.first = dict(self.numbers)
        return self.numbers

    def judge(self, alarm: Any) -> bool:
        """Update the alarm from the current numbers (`alarm`: proxy.config.QualityAlarmConfig);
        True when it changed. A number without enough evidence (fewer than min_episodes scored, or
        fewer than min_per_outcome of the outcomes it rests on) is no verdict: it neither raises nor
        clears."""
        n = self.numbers.get("n", 0)
        if n < alarm.min_episodes:
            return False
        enough_failures = self.numbers["failures"] >= alarm.min_per_outcome
        fsr = self.numbers["false_success_rate"] if enough_failures else None
        auc = self.numbers["auc"] if enough_failures and self.numbers["successes"] >= alarm.min_per_outcome else None
        if fsr is None and auc is None:
            return False
        breaches = []
        if fsr is not None and fsr > alarm.max_false_success_rate:
            breaches.append(f"false-success rate {fsr:.2f} > {alarm.max_false_success_rate:g}")
        if auc is not None and auc < alarm.min_auc:
            breaches.append(f"ROC-AUC {auc:.2f} < {alarm.min_auc:g}")
        if not self.alarmed:
            if breaches:
                self.alarmed, self.reason = True, f"{' and '.join(breaches)} over the last {n} scored episodes"
                return True
            return False
        # cleared only by evidence: each number judged is back inside by the margin
        inside = ((fsr is None or fsr <= alarm.max_false_success_rate - alarm.clear_margin)
                  and (auc is None or auc >= alarm.min_auc + alarm.clear_margin))
        if inside:
            self.alarmed, self.reason = False, None
            return True
        if breaches:  # still out: the reason follows the numbers (in the margin band it keeps the last)
            self.reason = f"{' and '.join(breaches)} over the last {n} scored episodes"
        return False

    def status(self, min_episodes: int) -> str:
        """alarm; ok once min_episodes scored episodes were judged; unknown before."""
        if self.alarmed:
            return ALARM
        return OK if self.numbers.get("n", 0) >= min_episodes else UNKNOWN
