"""A progress curve → per-step rewards as potential differences (Ng et al., 1999, with gamma = 1).

    phi(t)    = the curve's progress at step t: 0 at the reset frame (nothing done yet), linear
                between the curve's points, flat after its last point
    reward_t  = coef * (phi(t) - phi(t - 1))   for t >= 1; reward_0 = 0

The rewards add up to coef * phi(last step) — the curve's last point, i.e. the terminal reward the
hook pays with binary_reward false — so shaping moves credit to the steps where progress was
made without changing any episode's return (GRPO, which sums an episode's rewards, sees the same
number either way; per-step advantage estimators such as PPO with GAE see where it came from).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["potential_rewards"]


def potential_rewards(curve: Sequence[tuple[int, float]], steps: int, coef: float = 1.0) -> np.ndarray:
    """`steps` per-step rewards (one per frame of the episode, the reset frame first) from a curve
    of (step, progress in [0, 1]) points at increasing steps after the reset frame."""
    at = np.array([0, *(step for step, _ in curve)], dtype=np.float64)
    if not curve or np.any(np.diff(at) <= 0) or at[-1] >= steps:
        raise ValueError(f"a curve needs points at increasing steps within 1..{steps - 1}, got "
                         f"{[step for step, _ in curve]}")
    progress = np.array([0.0, *(score for _, score in curve)], dtype=np.float64)
    phi = np.interp(np.arange(steps, dtype=np.float64), at, progress)
    return coef * np.diff(phi, prepend=0.0)  # reward_0 = phi(0) - 0 = 0
