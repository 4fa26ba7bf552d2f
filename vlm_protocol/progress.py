"""What the proxy's POST /progress/batch and its clients agree on (docs/progress.md)."""

from __future__ import annotations

__all__ = ["OUTCOMES", "PROGRESS_PATH", "task_key"]

PROGRESS_PATH = "/progress/batch"
# success: progress 1; progress: a failure measured against its task's references; no_reference:
# a failure whose task has none (progress null, never a number).
OUTCOMES = ("success", "progress", "no_reference")


def task_key(task_id: int | str) -> str:
    """Episodes are grouped by their task id as text: 3 and "3" are one task (the reference
    store's keys are text too)."""
    return str(task_id)
