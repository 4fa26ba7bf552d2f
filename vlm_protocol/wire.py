"""Paths, header names and header parsing shared by the proxy and its clients."""

from __future__ import annotations

import email.utils
import math
import time

__all__ = ["BATCH_PATH", "BUDGET_HEADER", "DENSE_PATH", "FRAME_RULES_PATH", "HEALTH_PATH", "MAX_RETRY_AFTER_S",
           "REQUEST_ID_HEADER", "SCORE_PATH", "parse_retry_after"]

SCORE_PATH = "/score"
BATCH_PATH = "/score/batch"
DENSE_PATH = "/score/dense"
HEALTH_PATH = "/health"
FRAME_RULES_PATH = "/frame-rules"  # each backend's frame rules (vlm_protocol/frame_rules.py)

# The caller's remaining time budget for this request, in milliseconds. The proxy ends its own
# retries before it runs out, so it never works for a client that has already given up.
BUDGET_HEADER = "x-reward-budget-ms"
REQUEST_ID_HEADER = "x-request-id"

# A Retry-After beyond this is not a wait worth honouring (a year, "inf"): capped.
MAX_RETRY_AFTER_S = 300.0


def parse_retry_after(value: str | None, value_ms: str | None = None) -> float | None:
    """Seconds from `retry-after-ms` or `retry-after` (delta-seconds or an HTTP date), capped at
    MAX_RETRY_AFTER_S; None when absent or unreadable."""
    for raw, scale in ((value_ms, 1e-3), (value, 1.0)):
        if not raw:
            continue
        try:
            seconds = float(raw) * scale
        except ValueError:
            if scale != 1.0:
                continue
            try:
                seconds = email.utils.parsedate_to_datetime(raw).timestamp() - time.time()
            except (TypeError, ValueError):
                return None
        if not math.isfinite(seconds):
            return None if math.isnan(seconds) else MAX_RETRY_AFTER_S
        return min(max(0.0, seconds), MAX_RETRY_AFTER_S)
    return None
