"""The one retry policy (tenacity), built from a backend's RetryConfig.

Two budgets, one deadline:
- transport: connection errors, timeouts, 429/5xx and malformed replies are retried up to
  `attempts` times with jittered exponential backoff (at least the server's Retry-After), each
  retry on a different endpoint when the backend has one;
- parse: a reply without the declared answer is asked again up to `parse_attempts` times in
  all; each re-ask samples differently (`retry.reask`: temperature > 0, seed + ask number), so
  it can change the answer; each ask has its own transport budget;
- everything stops at the deadline: `deadline_s` after the request began, or earlier when the
  caller said how long it will wait (its budget, minus a margin to deliver the answer).
Worst case per request: attempts x parse_attempts upstream calls (4 x 2 = 8 by default).
A 4xx other than 429 (our request is wrong, e.g. mm kwargs refused) is never retried.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
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
    UpstreamUnavailable,
)

T = TypeVar("T")
P = TypeVar("P")

# Time kept back from a caller's budget to get the answer to it before it gives up.
BUDGET_MARGIN_S = 1.0
BUDGET_MARGIN_FRACTION = 0.1


@dataclass
class Attempt:
    """What one upstream call needs to know about where it stands."""

    number: int  # 1-based over the whole request
    parse_round: int  # 0 for the first ask, 1.. for re-asks after an unparseable reply
    timeout_s: float  # min(per-call timeout, time left before the deadline)
    avoid: set[str] = field(default_factory=set)  # endpoints that already failed this request
    sent: bool = False  # set once an endpoint was reserved: this attempt is an upstream call
    # The deadline (the caller's budget or retry.deadline_s), not timeout_s, set `timeout_s`: a
    # timeout then is the caller's, never held against the replica's circuit (backends.py).
    deadline_bound: bool = False
    until: float | None = None  # time.monotonic() by which the whole request must be done

    def slot_taken(self) -> None:
        """An endpoint slot was reserved: this attempt is an upstream call, and the time spent
        waiting for the slot comes off its timeout (never past the request's deadline). A slot that
        came free as the deadline ran out is no call: nothing is sent (attempts and retryable say so)."""
        if self.until is not None and (left := self.until - time.monotonic()) < self.timeout_s:
            if left <= 0:
                raise UpstreamTimeout("the request's deadline ran out as an in-flight slot came free")
            self.timeout_s, self.deadline_bound = left, True
        self.sent = True


class Deadline:
    """When a request must be finished by, and why (for the timeout message)."""

    def __init__(self, cfg: RetryConfig, budget_s: float | None = None) -> None:
        seconds, self.why = cfg.deadline_s, f"the deadline of {cfg.deadline_s:g}s (retry.deadline_s)"
        if budget_s is not None:
            usable = max(0.0, budget_s - min(BUDGET_MARGIN_S, budget_s * BUDGET_MARGIN_FRACTION))
            if usable < seconds:
                seconds, self.why = usable, f"the caller's budget of {budget_s:g}s"
        self.ends = time.monotonic() + seconds

    def left(self) -> float:
        return self.ends - time.monotonic()


def _wait_strategy(cfg: RetryConfig, deadline: Deadline):
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


def _stop_strategy(cfg: RetryConfig, deadline: Deadline):
    by_count = stop_after_attempt(cfg.attempts)

    def stop(state: RetryCallState) -> bool:
        return by_count(state) or deadline.left() <= 0.05

    return stop


async def call_with_retries(
    cfg: RetryConfig,
    send: Callable[[Attempt], Awaitable[T]],
    parse: Callable[[T], P],
    *,
    budget_s: float | None = None,
    on_reply: Callable[[T], None] | None = None,
) -> tuple[T, P, int]:
    """Run send → parse under the policy. Returns (reply, parsed, upstream calls made).

    `on_reply` sees every reply that came back (parsed or not), e.g. to keep the last one for
    the audit log. Raises the last ProxyError with `attempts` set when a budget or the
    deadline runs out.
    """
    deadline = Deadline(cfg, budget_s)
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
                        raise UpstreamTimeout(f"{deadline.why} ran out before vLLM answered")
                    current = Attempt(calls + 1, parse_round, min(cfg.timeout_s, left), avoid,
                                      deadline_bound=left < cfg.timeout_s, until=deadline.ends)
                    try:
                        reply = await send(current)
                    except UpstreamError as err:
                        if err.endpoint:
                            avoid.add(err.endpoint)
                        raise
                    finally:
                        calls += current.sent
            if on_reply is not None:
                on_reply(reply)
            try:
                return reply, parse(reply), calls
            except ScoreParseError as err:
                last_parse_error = err
                if deadline.left() <= 0:
                    break
        assert last_parse_error is not None
        asks = parse_round + 1
        last_parse_error.message = f"{last_parse_error.message} (after {asks} ask{'s' if asks > 1 else ''})"
        raise last_parse_error
    except ProxyError as err:
        err.attempts = calls
        if calls == 0 and isinstance(err, UpstreamUnavailable | UpstreamTimeout):
            err.retryable = True  # nothing reached vLLM: the caller may safely ask again
        raise
