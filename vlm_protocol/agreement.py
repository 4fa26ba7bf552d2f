"""How well a reward agrees with the simulator's success: the numbers the proxy's live monitor
(proxy/quality/) and the offline report (reports/quality.py) both compute, defined once here.

A score "says success" when score >= threshold, as the RLinf client maps it (binary_reward with
success_threshold). Pure: standard library only, lists in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["ALARM", "OK", "PROBE_KINDS", "RESET", "UNKNOWN", "agreement", "average_ranks", "roc_auc", "spearman",
           "voc"]

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
    rank_sum = sum(rank for rank, success in zip(average_ranks(scores), successes, strict=True) if success)
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


def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks, tied values sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end + 2) / 2.0
        start = end + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Spearman's rank correlation (Pearson's on average ranks, as scipy's spearmanr); None when
    either side is constant or there are fewer than 2 pairs."""
    if len(x) != len(y):
        raise ValueError(f"spearman needs pairs: {len(x)} x values, {len(y)} y values")
    if len(x) < 2:
        return None
    rx, ry = average_ranks(x), average_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None


def voc(values: Sequence[float]) -> float | None:
    """Value-order correlation (GVL, arXiv 2411.04549): the rank correlation of a curve's progress
    values with their frame order, in [-1, 1]. 1: the curve rises with time; about 0: unrelated;
    negative: it falls (a reversed video should score so). None for a constant curve or one
    point (OpenGVL writes 0 there: undefined is not "unrelated")."""
    return spearman(list(range(len(values))), values)
