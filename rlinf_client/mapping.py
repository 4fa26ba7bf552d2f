"""Episode score → RLinf LIBERO step rewards, the way RLinf's own LiberoEnv computes them.

RLinf (`rlinf/envs/libero/libero_env.py`, `_calc_step_reward`), per env and step t:

    value_t  = reward_coef * success_t  (- 1 when use_step_penalty)
    reward_t = value_t - value_{t-1}   when use_rel_reward (value before the first step = 0,
                                       zeroed again on reset: `prev_step_reward`)
             = value_t                 otherwise

With a reward model the simulator's success flag is replaced by the episode's mapped score,
which is 0 until the step the episode ends and `mapped` from then on (the seed's fork):

    mapped = 1.0 if score >= success_threshold else 0.0    when binary_reward
           = score                                          otherwise

So with use_rel_reward the episode gets reward_coef * mapped once, on its end step. GRPO sums
rewards up to and including the first done step (`calculate_scores`), which is that value.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = [
    "grpo_episode_return",
    "map_score",
    "native_step_rewards",
    "relative_step_reward",
    "terminal_step_rewards",
]


def map_score(score: float, *, binary_reward: bool, success_threshold: float) -> float:
    """The episode's success value from the VLM score (or from a fallback)."""
    score = float(score)
    if binary_reward:
        return 1.0 if score >= success_threshold else 0.0
    return score


def relative_step_reward(value: np.ndarray, prev_value: np.ndarray, *,
                         use_rel_reward: bool) -> np.ndarray:
    """RLinf's last step: the change from the previous step's value, or the value itself.

    The caller stores `value` as the new previous value when use_rel_reward (RLinf's
    `prev_step_reward`)."""
    value = np.asarray(value, dtype=np.float64)
    if use_rel_reward:
        return value - np.asarray(prev_value, dtype=np.float64)
    return value


def _step_rewards(values: Sequence[float], use_rel_reward: bool) -> list[float]:
    rewards, prev = [], 0.0
    for value in values:
        rewards.append(float(relative_step_reward(np.float64(value), np.float64(prev),
                                                  use_rel_reward=use_rel_reward)))
        if use_rel_reward:
            prev = value
    return rewards


def native_step_rewards(success: Sequence[bool], *, reward_coef: float, use_rel_reward: bool,
                        use_step_penalty: bool = False) -> list[float]:
    """One episode's rewards as RLinf computes them from the simulator's success flags (run A)."""
    penalty = -1.0 if use_step_penalty else 0.0
    return _step_rewards([penalty + reward_coef * float(s) for s in success], use_rel_reward)


def terminal_step_rewards(num_steps: int, end_step: int, mapped: float, *, reward_coef: float,
                          use_rel_reward: bool, use_step_penalty: bool = False) -> list[float]:
    """One episode's rewards with a reward model (runs B, C): the mapped score takes the place of
    the success flag from `end_step` (0-based) on."""
    penalty = -1.0 if use_step_penalty else 0.0
    values = [penalty + (reward_coef * mapped if t >= end_step else 0.0) for t in range(num_steps)]
    return _step_rewards(values, use_rel_reward)


def grpo_episode_return(rewards: Sequence[float], dones: Sequence[bool]) -> float:
    """What GRPO scores an episode with (RLinf `calculate_scores`): the sum of rewards up to and
    including the first done step."""
    total = 0.0
    for reward, done in zip(rewards, dones, strict=True):
        total += reward
        if done:
            break
    return total
