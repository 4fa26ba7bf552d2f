"""The reward-quality numbers: pure functions of score and ground-truth arrays (numpy), no I/O.

A score "says success" when score >= threshold, as the RLinf client maps it (binary_reward with
success_threshold). Agreement is measured on scored episodes whose line carries env_success.
"""

from __future__ import annotations

import math
from array import array
from typing import Any

import numpy as np

from reports.audit import NO_KEY, Episodes, Group
from vlm_protocol import agreement

__all__ = ["accuracy_at", "best_threshold", "brier", "calibration_numbers", "compare_numbers", "group_numbers",
           "histogram", "match_episodes", "percentiles", "reliability", "roc_auc", "roc_curve"]

HIST_BINS = 20
RELIABILITY_BINS = 10
QUANTILES = (50, 90, 99)
COMPARED = ("lines", "with_truth", "auc", "accuracy", "best_accuracy", "false_success_rate", "parse_failure_rate",
            "error_rate", "latency_p50", "latency_p99", "prompt_tokens_p50", "completion_tokens_p50")


def _arrays(scores: Any, truth: Any) -> tuple[np.ndarray, np.ndarray]:
    """Scores and 0/1 truth, without the episodes whose truth is unknown (-1)."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(truth, dtype=np.int8)
    known = y >= 0
    return s[known], y[known]


def roc_auc(scores: Any, truth: Any) -> float | None:
    """vlm_protocol.agreement's ROC-AUC (the live monitor's too) over the episodes with known truth."""
    s, y = _arrays(scores, truth)
    return agreement.roc_auc(s.tolist(), (y == 1).tolist())


def roc_curve(scores: Any, truth: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """(false-positive rate, true-positive rate) as the threshold falls through every score."""
    s, y = _arrays(scores, truth)
    positives, negatives = int((y == 1).sum()), int((y == 0).sum())
    if not positives or not negatives:
        return None
    order = np.argsort(-s, kind="mergesort")
    ordered, hits = s[order], y[order]
    last_of_tie = np.r_[ordered[1:] != ordered[:-1], True]
    tpr = np.r_[0.0, np.cumsum(hits == 1)[last_of_tie] / positives]
    fpr = np.r_[0.0, np.cumsum(hits == 0)[last_of_tie] / negatives]
    return fpr, tpr


def _agreement(scores: Any, truth: Any, threshold: float) -> dict[str, Any]:
    s, y = _arrays(scores, truth)
    return agreement.agreement(s.tolist(), (y == 1).tolist(), threshold)


def accuracy_at(scores: Any, truth: Any, threshold: float) -> dict[str, Any]:
    at = _agreement(scores, truth, threshold)
    return {key: at[key] for key in ("n", "correct", "accuracy", "false_success", "missed_success")}


def best_threshold(scores: Any, truth: Any) -> dict[str, Any]:
    """The threshold (one of the scores, or above them all) with the highest accuracy; the lowest
    such threshold on ties. inf = call every episode a failure."""
    s, y = _arrays(scores, truth)
    if not len(s):
        return {"threshold": None, "correct": 0, "accuracy": None}
    successes, failures = np.sort(s[y == 1]), np.sort(s[y == 0])
    candidates = np.r_[np.unique(s), math.inf]
    correct = (len(successes) - np.searchsorted(successes, candidates, "left")
               + np.searchsorted(failures, candidates, "left"))
    best = int(np.argmax(correct))
    return {"threshold": float(candidates[best]), "correct": int(correct[best]),
            "accuracy": _ratio(int(correct[best]), len(s))}


def percentiles(values: Any, quantiles: tuple[int, ...] = QUANTILES) -> dict[int, float | None]:
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        return dict.fromkeys(quantiles)
    return {q: float(x) for q, x in zip(quantiles, np.percentile(v, quantiles), strict=True)}


def histogram(scores: Any, truth: Any, bins: int = HIST_BINS) -> dict[str, np.ndarray]:
    """Counts per score bin ([0, 1] in `bins` equal bins) for successes, failures and unknown truth."""
    s, y = np.asarray(scores, dtype=np.float64), np.asarray(truth, dtype=np.int8)
    edges = np.linspace(0.0, 1.0, bins + 1)
    return {"edges": edges, **{name: np.histogram(s[y == value], edges)[0]
                               for name, value in (("success", 1), ("failure", 0), ("unknown", -1))}}


def reliability(scores: Any, truth: Any, bins: int = RELIABILITY_BINS) -> list[dict[str, Any]]:
    """Per score bin ([0, 1] in `bins` equal bins; bin i holds i/bins <= score < (i+1)/bins, 1.0 the
    last): episodes with known truth, successes, the observed success rate and the mean score."""
    s, y = _arrays(scores, truth)
    # int(score * bins), not np.histogram's edges: linspace's 0.30000000000000004 would put 0.3 below 0.3
    index = np.minimum((s * bins).astype(np.int64), bins - 1)
    rows = []
    for i in range(bins):
        inside = index == i
        n, hits = int(inside.sum()), int(y[inside].sum())
        rows.append({"low": i / bins, "high": (i + 1) / bins, "n": n, "successes": hits, "rate": _ratio(hits, n),
                     "mean_score": _mean(s[inside])})
    return rows


def brier(scores: Any, truth: Any) -> float | None:
    """Mean (score - success)^2 over the episodes with known truth: 0 is perfect."""
    s, y = _arrays(scores, truth)
    return _mean((s - y) ** 2)


def calibration_numbers(group: Group, *, bins: bool = True) -> dict[str, Any]:
    """Brier score (and, for reference, a constant's: the success rate p scores p(1 - p)), mean
    score, success rate and, with `bins`, the reliability bins of one backend or (backend, task)."""
    s, y = _arrays(group.scores, group.truth)
    rate = _mean(y.astype(np.float64))
    numbers: dict[str, Any] = {"n": len(s), "brier": brier(s, y), "brier_constant": None if rate is None
                               else rate * (1 - rate), "mean_score": _mean(s), "success_rate": rate}
    if bins:
        numbers["bins"] = reliability(s, y)
    return numbers


def group_numbers(group: Group, threshold: float) -> dict[str, Any]:
    """Every number the report shows for one backend or (backend, task)."""
    scores = np.frombuffer(group.scores, dtype=np.float64) if len(group.scores) else np.empty(0)
    truth = np.frombuffer(group.truth, dtype=np.int8) if len(group.truth) else np.empty(0, np.int8)
    at, best = _agreement(scores, truth, threshold), best_threshold(scores, truth)
    latency, prompt, completion = (percentiles(group.latency_ms), percentiles(group.prompt_tokens),
                                   percentiles(group.completion_tokens))
    numbers: dict[str, Any] = {
        "lines": group.lines, "scored": group.scored, "truth_lines": group.truth_lines,
        "with_truth": at["n"], "successes": int((truth == 1).sum()), "failures": int((truth == 0).sum()),
        "auc": at["auc"], "threshold": threshold, "accuracy": at["accuracy"],
        "correct": at["correct"], "false_success": at["false_success"], "missed_success": at["missed_success"],
        "false_success_rate": at["false_success_rate"],
        "best_accuracy": best["accuracy"], "best_threshold": best["threshold"], "best_correct": best["correct"],
        "mean_score_success": at["mean_score_success"], "mean_score_failure": at["mean_score_failure"],
        "parse_failures": group.parse_failures, "parse_failure_rate": _ratio(group.parse_failures, group.lines),
        "errors": group.failed, "error_rate": _ratio(group.failed, group.lines),
        "errors_by_code": dict(sorted(group.errors.items())),
    }
    for name, values in (("latency", latency), ("prompt_tokens", prompt), ("completion_tokens", completion)):
        numbers.update({f"{name}_p{q}": value for q, value in values.items()})
    return numbers


def compare_numbers(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any, Any]]:
    """(before, after, after - before) for each compared number; the delta is None when one is."""
    return {key: (before.get(key), after.get(key), _delta(before.get(key), after.get(key))) for key in COMPARED}


def match_episodes(before: Episodes, after: Episodes, threshold: float) -> dict[str, Any]:
    """The same episodes in two logs: agreement before and after on exactly the episodes both
    scored and whose truth is known. When every line of `after` is a replay (metadata.replay_of_line),
    a replayed line is matched to the line it replays: exact, whatever the episode ids. Otherwise
    by metadata.episode_id + task_text, where a key seen twice in one log counts once, its last line
    (RLinf's episode ids repeat across env workers: such a match is approximate)."""
    by_line = len(after.replay_of) > 0 and min(after.replay_of) > 0
    keys_b, scores_b, truth_b, dup_b = _last_per_key(before, before.lines if by_line else before.keys)
    keys_a, scores_a, truth_a, dup_a = _last_per_key(after, after.replay_of if by_line else after.keys)
    common, ib, ia = np.intersect1d(keys_b, keys_a, assume_unique=True, return_indices=True)
    sb, sa, yb, ya = scores_b[ib], scores_a[ia], truth_b[ib], truth_a[ia]
    conflicts = (yb >= 0) & (ya >= 0) & (yb != ya)
    both = ~np.isnan(sb) & ~np.isnan(sa) & (yb >= 0) & ~conflicts
    s_before, s_after, y = sb[both], sa[both], yb[both]
    right_before = (s_before >= threshold) == (y == 1)
    right_after = (s_after >= threshold) == (y == 1)
    return {
        "matched_by": "replay_of_line" if by_line else "episode_id + task_text",
        "matched": len(common), "compared": int(both.sum()),
        "unmatched_before": len(keys_b) - len(common), "unmatched_after": len(keys_a) - len(common),
        "duplicates_before": dup_b, "duplicates_after": dup_a, "truth_conflicts": int(conflicts.sum()),
        "scored_only_before": int((~np.isnan(sb) & np.isnan(sa)).sum()),
        "scored_only_after": int((np.isnan(sb) & ~np.isnan(sa)).sum()),
        "auc": (roc_auc(s_before, y), roc_auc(s_after, y)),
        "accuracy": (_ratio(int(right_before.sum()), len(y)), _ratio(int(right_after.sum()), len(y))),
        "best_accuracy": (best_threshold(s_before, y)["accuracy"], best_threshold(s_after, y)["accuracy"]),
        "fixed": int((~right_before & right_after).sum()), "broken": int((right_before & ~right_after).sum()),
        "mean_abs_change": _mean(np.abs(s_after - s_before)),
    }


def _last_per_key(episodes: Episodes, key_array: array) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    keys = np.frombuffer(key_array, dtype=np.int64) if len(key_array) else np.empty(0, np.int64)
    scores = np.frombuffer(episodes.scores, dtype=np.float64) if len(episodes.scores) else np.empty(0)
    truth = np.frombuffer(episodes.truth, dtype=np.int8) if len(episodes.truth) else np.empty(0, np.int8)
    if key_array is episodes.keys:  # lines without an episode_id cannot be matched by it
        keep = keys != NO_KEY
        keys, scores, truth = keys[keep], scores[keep], truth[keep]
    unique, first_from_end = np.unique(keys[::-1], return_index=True)
    last = len(keys) - 1 - first_from_end
    return unique, scores[last], truth[last], len(keys) - len(unique)


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _mean(values: np.ndarray) -> float | None:
    return float(values.mean()) if len(values) else None


def _delta(before: Any, after: Any) -> Any:
    if isinstance(before, int | float) and isinstance(after, int | float):
        return after - before
    return None
