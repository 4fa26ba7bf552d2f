"""RLinf's LIBERO reward formulas over whole episodes, restated as test oracles (the product only
computes the last step: rlinf_client.mapping.relative_step_reward). Both the client tests and the
real-RLinf tier compare against these."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rlinf_client.mapping import relative_step_reward


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
