"""What the LiberoEnv hook (hook.py) reads of the proxy's live reward-quality monitor: whether an
answer says its (run, backend, task) is in alarm, the warning's summary of the alarmed keys, and what
one ending episode is paid and why."""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

__all__ = ["Paid", "alarm_summary", "quality_alarm"]


class Paid(NamedTuple):
    """What one ending episode is paid, and why."""

    score: float  # mapped into the reward
    shown: float  # logged as vlm_score
    result: Any  # the client's EpisodeScore / EpisodeProgress
    native: bool = False  # on_quality_alarm: native paid the simulator's reward in place of the score
    alarm: bool = False  # the proxy's answer said quality alarm


def quality_alarm(result: Any) -> dict[str, Any] | None:
    """The answer's `quality` object when it says alarm; None for no information (an older proxy,
    a failed request, ok / unknown, or a malformed field)."""
    response = result.response if result.ok else None
    quality = response.get("quality") if isinstance(response, dict) else None
    return quality if isinstance(quality, dict) and quality.get("status") == "alarm" else None


def alarm_summary(flagged: list[dict[str, Any]]) -> str:
    """Each alarmed (run, backend, task) with the proxy's reason, and how many episodes had it."""
    labels: Counter[str] = Counter()
    for quality in flagged:
        key = quality.get("key") if isinstance(quality.get("key"), dict) else {}
        labels[f"run={key.get('run')} backend={key.get('backend')} task={key.get('task_id')}: "
               f"{quality.get('reason') or 'no reason given'}"] += 1
    return "; ".join(f"{label} x{count}" for label, count in labels.items())
