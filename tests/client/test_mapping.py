"""Score → reward, checked against hand-worked examples of RLinf's own code paths.

Native rewards follow `LiberoEnv._calc_step_reward` (value = reward_coef * success, minus 1 with
use_step_penalty; with use_rel_reward the change from the previous step's value); GRPO's
episode score follows `calculate_scores` (sum up to and including the first done step); the
group filter follows `filter_rewards` (group mean within [rewards_lower_bound, upper]).
LIBERO-10 config: reward_coef 5.0, use_rel_reward True, filter bounds [0.5, 4.5].
"""

from __future__ import annotations

import pytest

from rlinf_client.mapping import map_score
from tests.rlinf_semantics import grpo_episode_return, native_step_rewards, terminal_step_rewards

COEF = 5.0


@pytest.mark.parametrize(("score", "binary", "mapped"), [
    (0.8, True, 1.0), (0.5, True, 1.0), (0.4999, True, 0.0), (0.0, True, 0.0), (1.0, True, 1.0),
    (0.8, False, 0.8), (0.3, False, 0.3), (0.0, False, 0.0),
])
def test_map_score(score, binary, mapped):
    assert map_score(score, binary_reward=binary, success_threshold=0.5) == mapped


# (success flags per step, use_rel_reward, use_step_penalty) -> (rewards, GRPO return)
NATIVE = [
    # succeeds at step 3 and stays: +coef once (the contract's "net" reward)
    ([0, 0, 0, 1, 1, 1], True, False, [0, 0, 0, 5, 0, 0], 5),
    # success lost and regained: -coef then +coef again; GRPO stops at the first done step
    ([0, 1, 0, 1], True, False, [0, 5, -5, 5], 5),
    # absolute rewards: the value on every successful step
    ([0, 0, 1, 1], False, False, [0, 0, 5, 5], 5),
    # step penalty with relative rewards: -1 on the first step only, then +coef
    ([0, 0, 1], True, True, [-1, 0, 5], 4),
    # step penalty with absolute rewards: -1 on every step before success
    ([0, 0, 1], False, True, [-1, -1, 4], 2),
    # never succeeds (truncated at the last step): nothing
    ([0, 0, 0, 0], True, False, [0, 0, 0, 0], 0),
]


@pytest.mark.parametrize(("flags", "rel", "penalty", "rewards", "episode_return"), NATIVE)
def test_native_rewards_match_rlinf(flags, rel, penalty, rewards, episode_return):
    got = native_step_rewards([bool(f) for f in flags], reward_coef=COEF, use_rel_reward=rel,
                              use_step_penalty=penalty)
    assert got == pytest.approx(rewards)
    dones = [bool(f) for f in flags[:-1]] + [True]  # done on success, else truncated at the end
    assert grpo_episode_return(got, dones) == pytest.approx(episode_return)


# (steps, end step, score, binary, rel, penalty) -> rewards
TERMINAL = [
    # run B/C on LIBERO-10 (binary, relative): same as the native reward when the VLM agrees
    (6, 3, 0.8, True, True, False, [0, 0, 0, 5, 0, 0]),
    (6, 3, 0.3, True, True, False, [0, 0, 0, 0, 0, 0]),
    (6, 3, 0.5, True, True, False, [0, 0, 0, 5, 0, 0]),  # the threshold counts as success
    # continuous scores: coef x score once, on the end step
    (6, 3, 0.8, False, True, False, [0, 0, 0, 4, 0, 0]),
    # absolute rewards keep the value after the end (as the seed's fork; GRPO masks them)
    (6, 3, 0.8, False, False, False, [0, 0, 0, 4, 4, 4]),
    # step penalty, relative: -1 first, then the terminal reward
    (6, 3, 0.8, False, True, True, [-1, 0, 0, 4, 0, 0]),
    # a truncated failure still gets its (partial) score on the last step
    (4, 3, 0.3, False, True, False, [0, 0, 0, 1.5]),
]


@pytest.mark.parametrize(("steps", "end", "score", "binary", "rel", "penalty", "rewards"), TERMINAL)
def test_terminal_rewards(steps, end, score, binary, rel, penalty, rewards):
    mapped = map_score(score, binary_reward=binary, success_threshold=0.5)
    got = terminal_step_rewards(steps, end, mapped, reward_coef=COEF, use_rel_reward=rel,
                                use_step_penalty=penalty)
    assert got == pytest.approx(rewards)
    dones = [t >= end for t in range(steps)]
    assert grpo_episode_return(got, dones) == pytest.approx(sum(rewards[:end + 1]))


def test_binary_vlm_that_agrees_with_the_simulator_gives_the_native_rewards():
    flags = [False] * 7 + [True] * 5
    native = native_step_rewards(flags, reward_coef=COEF, use_rel_reward=True)
    vlm = terminal_step_rewards(len(flags), flags.index(True), map_score(0.9, binary_reward=True,
                                success_threshold=0.5), reward_coef=COEF, use_rel_reward=True)
    assert vlm == native


def _kept_by_filter(group_returns: list[float], lower: float = 0.5, upper: float = 4.5) -> bool:
    mean = sum(group_returns) / len(group_returns)
    return lower <= mean <= upper


def test_continuous_scores_change_which_grpo_groups_survive_the_filter():
    # A group of 8 failures: natively (and with binary VLM rewards) every return is 0 -> dropped.
    assert not _kept_by_filter([0.0] * 8)
    # With continuous VLM scores of 0.2 each return is 5 x 0.2 = 1.0 -> the group is kept.
    returns = [sum(terminal_step_rewards(512, 511, 0.2, reward_coef=COEF, use_rel_reward=True))] * 8
    assert returns[0] == pytest.approx(1.0) and _kept_by_filter(returns)
    # A group of 8 successes: 5.0 natively -> dropped; at 0.9 each it is 4.5 -> kept.
    assert not _kept_by_filter([5.0] * 8)
    assert _kept_by_filter([COEF * 0.9] * 8)
