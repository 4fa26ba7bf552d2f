"""The retry policy on its own: budgets, Retry-After, deadline, no retry for a refused request."""

import pytest

from proxy.config import RetryConfig
from proxy.errors import MediaKwargsRefused, ScoreParseError, UpstreamTimeout, UpstreamUnavailable
from proxy.upstream.retry import Deadline, _wait_strategy, call_with_retries

FAST = RetryConfig(attempts=4, parse_attempts=2, backoff_s=(0.001, 0.002), deadline_s=5)


def _scripted(outcomes):
    """send() that raises or returns the next outcome, recording each Attempt."""
    seen = []

    async def send(attempt):
        seen.append(attempt)
        attempt.sent = True  # as Backend.call does once it holds an endpoint
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return send, seen


def _parse(text):
    if text == "garbage":
        raise ScoreParseError("no score")
    return float(text)


async def test_transport_errors_retry_then_succeed_on_other_endpoints():
    send, seen = _scripted([UpstreamUnavailable("x", endpoint="a"), UpstreamTimeout("y", endpoint="b"), "0.5"])
    reply, parsed, calls = await call_with_retries(FAST, send, _parse)
    assert (reply, parsed, calls) == ("0.5", 0.5, 3)
    assert seen[-1].avoid == {"a", "b"}  # the third try was told to avoid both failed endpoints


async def test_unparseable_reply_is_asked_again_in_its_own_budget():
    send, seen = _scripted(["garbage", "0.25"])
    _, parsed, calls = await call_with_retries(FAST, send, _parse)
    assert parsed == 0.25 and calls == 2
    assert [a.parse_round for a in seen] == [0, 1]


async def test_parse_budget_exhausted_raises_with_attempts():
    send, _ = _scripted(["garbage", "garbage", "0.1"])
    with pytest.raises(ScoreParseError) as err:
        await call_with_retries(FAST, send, _parse)
    assert err.value.attempts == 2 and "after 2 asks" in err.value.message


async def test_transport_budget_exhausted_raises_the_last_error_with_attempts():
    send, _ = _scripted([UpstreamUnavailable("down")] * 4)
    with pytest.raises(UpstreamUnavailable) as err:
        await call_with_retries(FAST, send, _parse)
    assert err.value.attempts == 4


async def test_refused_request_is_not_retried():
    send, seen = _scripted([MediaKwargsRefused("refused"), "0.5"])
    with pytest.raises(MediaKwargsRefused) as err:
        await call_with_retries(FAST, send, _parse)
    assert len(seen) == 1 and err.value.attempts == 1


async def test_deadline_bounds_the_whole_request():
    cfg = RetryConfig(attempts=50, parse_attempts=1, backoff_s=(0.05, 0.05), deadline_s=0.2)
    send, seen = _scripted([UpstreamUnavailable("down")] * 50)
    with pytest.raises((UpstreamUnavailable, UpstreamTimeout)):
        await call_with_retries(cfg, send, _parse)
    assert len(seen) < 50
    assert all(a.timeout_s <= 0.2 for a in seen)


def test_wait_honours_retry_after_but_not_past_the_deadline():
    class State:
        attempt_number = 1

        class outcome:  # noqa: N801 - mimics tenacity's RetryCallState
            @staticmethod
            def exception():
                return UpstreamUnavailable("busy", retry_after_s=2.0)

    cfg = RetryConfig(backoff_s=(0.01, 1.0))
    assert _wait_strategy(cfg, Deadline(RetryConfig(deadline_s=60)))(State) == pytest.approx(2.0)
    assert _wait_strategy(cfg, Deadline(RetryConfig(deadline_s=0.5)))(State) <= 0.5


def test_the_callers_budget_caps_the_deadline_with_a_margin_to_answer():
    cfg = RetryConfig(deadline_s=300)
    assert Deadline(cfg).left() == pytest.approx(300, abs=1)
    capped = Deadline(cfg, budget_s=20)
    assert 18.5 < capped.left() <= 19.0 and "budget of 20s" in capped.why
    assert Deadline(cfg, budget_s=1000).left() == pytest.approx(300, abs=1)  # the config's is shorter


async def test_a_budget_ends_retries_before_the_caller_gives_up():
    cfg = RetryConfig(attempts=50, parse_attempts=1, backoff_s=(0.05, 0.05), deadline_s=300)
    send, seen = _scripted([UpstreamUnavailable("down")] * 50)
    with pytest.raises((UpstreamUnavailable, UpstreamTimeout)):
        await call_with_retries(cfg, send, _parse, budget_s=0.3)
    assert len(seen) < 50 and all(a.timeout_s < 0.3 for a in seen)


async def test_an_attempt_knows_whether_the_deadline_or_its_own_timeout_bounds_it():
    """What decides whether a timeout is held against the replica (proxy.upstream.backends.note_failure)."""
    short_budget = RetryConfig(attempts=1, parse_attempts=1, timeout_s=60, deadline_s=300)
    send, seen = _scripted(["0.5"])
    await call_with_retries(short_budget, send, _parse, budget_s=2)
    assert seen[0].deadline_bound and seen[0].timeout_s < 2  # the caller's budget set the wait
    own_timeout = RetryConfig(attempts=1, parse_attempts=1, timeout_s=5, deadline_s=300)
    send, seen = _scripted(["0.5"])
    await call_with_retries(own_timeout, send, _parse, budget_s=100)
    assert not seen[0].deadline_bound and seen[0].timeout_s == 5  # the full per-call timeout


async def test_a_failure_before_any_upstream_call_is_retryable_and_counts_no_attempt():
    async def never_reaches_vllm(attempt):
        raise UpstreamUnavailable("every endpoint is out of rotation")  # the pool refused: not sent

    with pytest.raises(UpstreamUnavailable) as err:
        await call_with_retries(FAST, never_reaches_vllm, _parse)
    assert err.value.attempts == 0 and err.value.retryable is True
    send, _ = _scripted([UpstreamUnavailable("down")] * 4)
    with pytest.raises(UpstreamUnavailable) as err:
        await call_with_retries(FAST, send, _parse)
    assert err.value.attempts == 4 and err.value.retryable is False  # vLLM was called: not again
