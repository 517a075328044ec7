"""Group-relative advantages (GRPO; Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300).

Invariants:
- The advantage of a trajectory is its reward minus the mean reward of its group, optionally divided by the
  group's standard deviation (population std, ``ddof=0``) plus ``eps``.
- A group whose rewards are all equal (std <= ``ZERO_STD``) carries no learning signal: every advantage in it
  is exactly 0.0 and it is counted as a zero-advantage group.
- Advantages are float32 and have the shape of the rewards; inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tandem.core.records import Group

ZERO_STD = 1e-8
"""Groups whose reward std is at or below this are treated as having zero variance (all advantages 0)."""


def group_advantages(rewards: np.ndarray, normalize_std: bool = True, eps: float = 1e-6) -> np.ndarray:
    """GRPO advantages of one group: ``r - mean(r)``, divided by ``std(r) + eps`` when ``normalize_std``.

    Zero-variance groups (including groups of one) get all-zero advantages.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be a 1-D array of one group's rewards, got shape {r.shape}")
    if r.size == 0:
        return np.zeros(0, np.float32)
    if not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be finite, got {r.tolist()}; fix the reward function")
    std = float(r.std())
    if std <= ZERO_STD:
        return np.zeros(r.shape, np.float32)
    adv = r - r.mean()
    if normalize_std:
        adv = adv / (std + eps)
    return adv.astype(np.float32)


def is_zero_variance(rewards: np.ndarray) -> bool:
    """True when a group's rewards are all equal (it contributes no policy gradient)."""
    r = np.asarray(rewards, dtype=np.float64)
    return r.size == 0 or float(r.std()) <= ZERO_STD


@dataclass
class StepAdvantages:
    """Advantages of a step's trajectories, indexed ``[group][trajectory]``, and the zero-variance count."""

    per_group: list[np.ndarray]
    zero_adv_groups: int


def compute_advantages(groups: list[Group], normalize_std: bool = True, eps: float = 1e-6) -> StepAdvantages:
    """Group-relative advantages for each group of a step, counting zero-variance groups."""
    per_group = []
    zero = 0
    for g in groups:
        rewards = g.rewards()
        zero += int(is_zero_variance(rewards))
        per_group.append(group_advantages(rewards, normalize_std=normalize_std, eps=eps))
    return StepAdvantages(per_group, zero)
