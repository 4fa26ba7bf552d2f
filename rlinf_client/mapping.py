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
Whole-episode forms of these formulas, used only as test oracles, are in tests/rlinf_semantics.py.
"""

from __future__ import annotations

import numpy as np

__all__ = ["map_score", "relative_step_reward"]


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
