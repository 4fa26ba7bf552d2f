"""How well a reward agrees with the simulator's success: the numbers the proxy's live monitor
(proxy/quality/) and the offline report (reports/quality.py) both compute, defined once here.

A score "says success" when score >= threshold, as the RLinf client maps it (binary_reward with
success_threshold). Pure: standard library only, lists in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ALARM", "OK", "PROBE_KINDS", "RESET", "UNKNOWN", "agreement", "roc_auc"]

# The live monitor's words, as the proxy writes them (answers, /quality, audit lines) and `report`
# reads them: a key's status, and the kinds of invariance probe (in the order they are shown).
ALARM, OK, UNKNOWN = "alarm", "ok", "unknown"
RESET = "reset"  # an audit line only: the proxy stopped with the key in alarm
PROBE_KINDS = ("reversed", "shuffled", "instruction")


def roc_auc(scores: Sequence[float], successes: Sequence[bool]) -> float | None:
    """P(a random success scores above a random failure), ties counting half: the Mann-Whitney U
    over n_success x n_failure, from average ranks. None without both outcomes."""
    n = len(scores)
    positives = sum(1 for s in successes if s)
    negatives = n - positives
    if not positives or not negatives:
        return None
    order = sorted(range(n), key=scores.__getitem__)
    rank_sum, start = 0.0, 0
    while start < n:  # one run of tied scores: each gets the mean of the ranks start+1 .. end
        end = start
        while end + 1 < n and scores[order[end + 1]] == scores[order[start]]:
            end += 1
        hits = sum(1 for k in range(start, end + 1) if successes[order[k]])
        rank_sum += hits * (start + end + 2) / 2.0
        start = end + 1
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def agreement(scores: Sequence[float], successes: Sequence[bool], threshold: float) -> dict[str, Any]:
    """Every agreement number for episodes with known success: counts, ROC-AUC, accuracy at the
    threshold, false successes (failures the reward calls a success) and their rate among the
    failures, missed successes, and the mean score by outcome (None where undefined)."""
    n = len(scores)
    said = [score >= threshold for score in scores]
    positives = sum(1 for s in successes if s)
    negatives = n - positives
    correct = sum(1 for a, y in zip(said, successes, strict=True) if a == bool(y))
    false_success = sum(1 for a, y in zip(said, successes, strict=True) if a and not y)
    on_success = [s for s, y in zip(scores, successes, strict=True) if y]
    on_failure = [s for s, y in zip(scores, successes, strict=True) if not y]
    return {
        "n": n, "successes": positives, "failures": negatives, "auc": roc_auc(scores, successes),
        "threshold": threshold, "correct": correct, "accuracy": correct / n if n else None,
        "false_success": false_success, "false_success_rate": false_success / negatives if negatives else None,
        "missed_success": sum(1 for a, y in zip(said, successes, strict=True) if y and not a),
        "mean_score_success": sum(on_success) / len(on_success) if on_success else None,
        "mean_score_failure": sum(on_failure) / len(on_failure) if on_failure else None,
    }
