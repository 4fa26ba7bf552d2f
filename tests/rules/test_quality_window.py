"""The live monitor's rule (proxy/quality/window.py) and the agreement numbers it shares with
`report` (vlm_protocol/agreement.py), checked against brute force."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from proxy.config import QualityAlarmConfig, QualityConfig
from proxy.quality.window import KeyWindow
from reports.quality import roc_auc as report_roc_auc
from vlm_protocol.agreement import ALARM, OK, UNKNOWN, agreement, roc_auc

ALARM_CFG = QualityAlarmConfig(min_episodes=8, max_false_success_rate=0.3, min_auc=0.6, clear_margin=0.05)


def brute_auc(scores, successes):
    pos = [s for s, y in zip(scores, successes, strict=True) if y]
    neg = [s for s, y in zip(scores, successes, strict=True) if not y]
    if not pos or not neg:
        return None
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)) / (len(pos) * len(neg))


@pytest.mark.parametrize("seed", range(20))
def test_auc_equals_the_pairwise_count_ties_included(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 60)
    scores = [rng.choice([0.0, 0.25, 0.5, 0.75, 1.0, rng.random()]) for _ in range(n)]
    successes = [rng.random() < 0.5 for _ in range(n)]
    expected = brute_auc(scores, successes)
    got = roc_auc(scores, successes)
    assert got is None if expected is None else got == pytest.approx(expected)
    # the report reads the same numbers (numpy arrays, -1 = unknown truth left out)
    truth = np.array([int(y) for y in successes] + [-1], dtype=np.int8)
    got = report_roc_auc(np.array([*scores, 0.3]), truth)
    assert got == roc_auc(scores, successes)


def test_agreement_numbers_by_hand():
    scores = [0.9, 0.8, 0.2, 0.6, 0.1, 0.7]
    successes = [True, True, True, False, False, False]
    at = agreement(scores, successes, 0.5)
    # said success: 0.9 0.8 | 0.6 0.7 (two failures called successes), missed: 0.2
    assert at["n"] == 6 and at["successes"] == 3 and at["failures"] == 3
    assert at["false_success"] == 2 and at["false_success_rate"] == pytest.approx(2 / 3)
    assert at["missed_success"] == 1 and at["accuracy"] == pytest.approx(3 / 6)
    assert at["mean_score_success"] == pytest.approx((0.9 + 0.8 + 0.2) / 3)
    assert at["mean_score_failure"] == pytest.approx((0.6 + 0.1 + 0.7) / 3)
    assert at["auc"] == pytest.approx(brute_auc(scores, successes))


def feed(window: KeyWindow, pairs) -> list[bool]:
    changes = []
    for score, success in pairs:
        window.add(score, success, 0.5)
        changes.append(window.judge(ALARM_CFG))
    return changes


def test_unknown_until_enough_episodes_then_ok():
    window = KeyWindow(16)
    feed(window, [(0.9, True), (0.1, False)] * 3)  # 6 < min_episodes 8
    assert window.status(ALARM_CFG.min_episodes) == UNKNOWN
    feed(window, [(0.9, True), (0.1, False)])
    assert window.status(ALARM_CFG.min_episodes) == OK and window.numbers["auc"] == 1.0


def test_a_hacked_reward_raises_the_alarm_and_it_clears_with_hysteresis():
    window = KeyWindow(20)
    feed(window, [(0.9, True), (0.1, False)] * 10)  # agrees: full window
    assert window.first is not None and window.first["false_success_rate"] == 0.0
    # failures now scored as successes: the alarm fires once the window's false-success rate > 0.3
    changes = feed(window, [(0.9, True), (0.9, False)] * 10)
    fired = changes.index(True)
    assert window.alarmed and window.status(8) == ALARM and "false-success rate" in window.reason
    assert sum(changes) == 1  # one transition, no flapping
    assert fired < 20  # within one window
    assert window.first["false_success_rate"] == 0.0  # the first window is kept for comparison
    # recovering: it clears only once the rate is 0.05 below the bound (and AUC 0.05 above its own)
    changes = feed(window, [(0.9, True), (0.1, False)] * 10)
    assert changes.count(True) == 1 and not window.alarmed and window.status(8) == OK


def test_at_the_bound_an_alarm_neither_fires_nor_clears():
    window = KeyWindow(20)
    # 10 failures, 3 of them called successes: rate 0.3 is not > 0.3
    for score, success in [(0.9, True)] * 10 + [(0.9, False)] * 3 + [(0.1, False)] * 7:
        window.add(score, success, 0.5)
    assert window.numbers["false_success_rate"] == pytest.approx(0.3)
    assert not window.judge(ALARM_CFG) and not window.alarmed
    window.alarmed, window.reason = True, "set"  # in alarm at the same numbers: 0.3 > 0.25, so it holds
    window.add(0.9, True, 0.5)
    assert not window.judge(ALARM_CFG) and window.alarmed


def test_parse_failures_are_counted_never_scored():
    window = KeyWindow(10)
    feed(window, [(None, False), (0.9, True), (0.1, False)])
    assert window.numbers["parse_failures"] == 1 and window.numbers["n"] == 2 and window.numbers["episodes"] == 3


def test_the_window_must_hold_the_minimum():
    with pytest.raises(ValueError, match="min_episodes"):
        QualityConfig(window=16, alarm={"min_episodes": 32})


def test_a_handful_of_one_outcome_is_no_verdict():
    """127 successes and one failure scored high: a false-success rate of 1.0 resting on one failure
    raises nothing; nor does a ROC-AUC resting on one success."""
    window = KeyWindow(128)
    feed(window, [(0.9, True)] * 127 + [(0.9, False)])
    assert window.numbers["false_success_rate"] == 1.0 and not window.alarmed
    window = KeyWindow(128)
    feed(window, [(0.1, True)] + [(0.2, False)] * 127)
    assert window.numbers["auc"] == 0.0 and not window.alarmed


def test_an_alarm_is_not_cleared_by_a_window_that_lost_its_evidence():
    window = KeyWindow(20)
    feed(window, [(0.9, True), (0.9, False)] * 10)
    assert window.alarmed
    feed(window, [(0.9, True)] * 20)  # no failures left: no verdict, the alarm holds
    assert window.alarmed and window.numbers["false_success_rate"] is None


def test_a_margin_that_cannot_clear_is_refused_and_kinds_are_unique():
    with pytest.raises(ValueError, match="clear_margin"):
        QualityConfig(alarm={"max_false_success_rate": 0.02, "clear_margin": 0.05})
    with pytest.raises(ValueError, match="twice"):
        QualityConfig(probes={"kinds": ["reversed", "reversed"]})
