"""The report's numbers, computed the slow and obvious way (for comparing with the page)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def auc_by_pairs(scores: list[float], truth: list[bool]) -> float:
    """Every (success, failure) pair: 1 if the success scores higher, 1/2 on a tie."""
    successes = [s for s, y in zip(scores, truth, strict=True) if y]
    failures = [s for s, y in zip(scores, truth, strict=True) if not y]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in successes for n in failures)
    return wins / (len(successes) * len(failures))


def correct_at(scores: list[float], truth: list[bool], threshold: float) -> int:
    return sum((s >= threshold) == y for s, y in zip(scores, truth, strict=True))


def best_by_trying(scores: list[float], truth: list[bool]) -> tuple[int, float]:
    """(correct, threshold): every score as the threshold, and one above them all; the lowest wins ties."""
    best = (-1, math.inf)
    for threshold in [*sorted(set(scores)), math.inf]:
        correct = correct_at(scores, truth, threshold)
        if correct > best[0]:
            best = (correct, threshold)
    return best


def linear_percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def audit_lines(path: Path, backend: str) -> list[dict]:
    lines = []
    for raw in path.read_text().splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("backend") == backend:
            lines.append(record)
    return lines
