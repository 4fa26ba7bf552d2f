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

With reward_source: progress (run D, SRPO) the score is the episode's progress from the proxy's
/progress/batch (`map_progress`): 1 for a success (RLinf's native success), progress x progress_coef
for a failure, and no number at all for a failure without a reference (the hook pays the native
reward, 0, or raises). binary_reward is false there, so `map_score` passes the value through.
Whole-episode forms of these formulas, used only as test oracles, are in tests/rlinf_semantics.py.
"""

from __future__ import annotations

import numpy as np

__all__ = ["map_progress", "map_score", "relative_step_reward"]


def map_score(score: float, *, binary_reward: bool, success_threshold: float) -> float:
    """The episode's success value from the VLM score (or from a fallback)."""
    score = float(score)
    if binary_reward:
        return 1.0 if score >= success_threshold else 0.0
    return score


def map_progress(outcome: str, progress: float | None, *, progress_coef: float) -> float | None:
    """The score a /progress/batch outcome stands for: success 1.0; progress (a failure) progress x
    progress_coef (SRPO pays 0.6 x progress); no_reference None — there is no number to pay, and
    none is made up here."""
    if outcome == "success":
        return 1.0
    if outcome == "progress":
        if progress is None:
            raise ValueError("outcome progress without a progress")
        return float(progress) * progress_coef
    if outcome == "no_reference":
        return None
    raise ValueError(f"unknown progress outcome {outcome!r}")


def relative_step_reward(value: np.ndarray, prev_value: np.ndarray, *,
                         use_rel_reward: bool) -> np.ndarray:
    """RLinf's last step: the change from the previous step's value, or the value itself.

    The caller stores `value` as the new previous value when use_rel_reward (RLinf's
    `prev_step_reward`)."""
    value = np.asarray(value, dtype=np.float64)
    if use_rel_reward:
        return value - np.asarray(prev_value, dtype=np.float64)
    return value
