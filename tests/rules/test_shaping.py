"""Potential-based shaping of a progress curve (rlinf_client/shaping.py): its defining properties."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rlinf_client.shaping import potential_rewards


@st.composite
def curves(draw):
    steps = draw(st.integers(2, 600))
    at = sorted(draw(st.sets(st.integers(1, steps - 1), min_size=1, max_size=min(16, steps - 1))))
    scores = draw(st.lists(st.floats(0, 1), min_size=len(at), max_size=len(at)))
    return list(zip(at, scores, strict=True)), steps


@given(curves(), st.floats(0.1, 10))
def test_the_rewards_add_up_to_the_last_point_and_pay_nothing_for_the_reset_frame(case, coef):
    curve, steps = case
    rewards = potential_rewards(curve, steps, coef)
    assert rewards.shape == (steps,) and rewards[0] == 0.0
    assert rewards.sum() == pytest.approx(coef * curve[-1][1], abs=1e-9)
    # Up to each point, the rewards add up to that point's progress (phi is the curve there).
    for step, score in curve:
        assert rewards[: step + 1].sum() == pytest.approx(coef * score, abs=1e-9)


@given(curves())
def test_a_rising_curve_never_pays_a_negative_step(case):
    curve, steps = case
    rising = [(step, score) for step, score in zip([s for s, _ in curve], sorted(v for _, v in curve), strict=True)]
    assert np.all(potential_rewards(rising, steps) >= -1e-12)


@pytest.mark.parametrize("curve", [[], [(0, 0.5)], [(5, 0.2), (5, 0.3)], [(6, 0.2), (3, 0.3)], [(10, 0.5)]])
def test_curves_that_are_not_within_the_episode_are_refused(curve):
    with pytest.raises(ValueError, match="increasing steps"):
        potential_rewards(curve, 10)
