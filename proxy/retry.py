"""The one retry policy (tenacity), built from a backend's RetryConfig.

Two budgets, one deadline:
- transport: connection errors, timeouts, 429/5xx and malformed replies are retried up to
  `attempts` times with jittered exponential backoff (at least the server's Retry-After), each
  retry on a different endpoint when the backend has one;
- parse: a reply without a score is asked again up to `parse_attempts` times (optionally at
  `parse_retry_temperature`), each ask with its own transport budget;
- everything stops at `deadline_s` after the request began.
A 4xx other than 429 (our request is wrong, e.g. mm kwargs refused) is never retried.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt
from tenacity.wait import wait_random_exponential

from proxy.config import RetryConfig
from proxy.errors import (
    RETRYABLE_UPSTREAM,
    ProxyError,
    ScoreParseError,
    UpstreamError,
    UpstreamTimeout,
)

T = TypeVar("T")
P = TypeVar("P")


@dataclass
class Attempt:
    """What one upstream call needs to know about where it stands."""

    number: int  # 1-based over the whole request
    parse_round: int  # 0 for the first ask, 1.. for re-asks after an unparseable reply
    timeout_s: float  # min(per-call timeout, time left before the deadline)
    avoid: set[str]  # endpoints that already failed this request


class _Deadline:
    def __init__(self, seconds: float) -> None:
        self.ends = time.monotonic() + seconds

    def left(self) -> float:
        return self.ends - time.monotonic()


def _wait_strategy(cfg: RetryConfig, deadline: _Deadline):
    jittered = wait_random_exponential(multiplier=cfg.backoff_s[0], max=cfg.backoff_s[1])

    def wait(state: RetryCallState) -> float:
        delay = jittered(state)
        error = state.outcome.exception() if state.outcome else None
        retry_after = getattr(error, "retry_after_s", None)
        if retry_after is not None:
            delay = max(delay, min(retry_after, cfg.backoff_s[1] * 4))
        # Never sleep past the deadline; the next try then fails fast with a timeout.
        return max(0.0, min(delay, deadline.left()))

    return wait


def _stop_strategy(cfg: RetryConfig, deadline: _Deadline):
    by_count = stop_after_attempt(cfg.attempts)

    def stop(state: RetryCallState) -> bool:
        return by_count(state) or deadline.left() <= 0.05

    return stop


async def call_with_retries(
    cfg: RetryConfig,
    send: Callable[[Attempt], Awaitable[T]],
    parse: Callable[[T], P],
) -> tuple[T, P, int]:
    """Run send → parse under the policy. Returns (reply, parsed, upstream calls made).

    Raises the last ProxyError with `attempts` set when a budget or the deadline runs out.
    """
    deadline = _Deadline(cfg.deadline_s)
    calls = 0
    avoid: set[str] = set()
    last_parse_error: ScoreParseError | None = None
    try:
        for parse_round in range(cfg.parse_attempts):
            retrying = AsyncRetrying(
                retry=retry_if_exception_type(RETRYABLE_UPSTREAM),
                stop=_stop_strategy(cfg, deadline),
                wait=_wait_strategy(cfg, deadline),
                reraise=True,
            )
            async for attempt in retrying:
                with attempt:
                    left = deadline.left()
                    if left <= 0:
                        raise UpstreamTimeout(f"deadline of {cfg.deadline_s:g}s reached")
                    calls += 1
                    try:
                        reply = await send(Attempt(calls, parse_round, min(cfg.timeout_s, left), avoid))
                    except UpstreamError as err:
                        if err.endpoint:
                            avoid.add(err.endpoint)
                        raise
            try:
                return reply, parse(reply), calls
            except ScoreParseError as err:
                last_parse_error = err
                if deadline.left() <= 0:
                    break
        assert last_parse_error is not None
        last_parse_error.message = (f"{last_parse_error.message} (after {cfg.parse_attempts} "
                                    f"ask{'s' if cfg.parse_attempts > 1 else ''})")
        raise last_parse_error
    except ProxyError as err:
        err.attempts = calls
        raise
