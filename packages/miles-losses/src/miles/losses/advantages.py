"""Advantage estimators: per-sample rewards to per-sample advantages.

Each is ``estimator(rewards f32[n], group_ids i64[n]) -> f32[n]`` over the whole step's batch,
vectorised with `np.bincount` over groups; group ids need not be contiguous or sorted.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from miles.losses.configs import GAEConfig, GRPOConfig, ReinforcePPConfig, RLOOConfig
from miles.losses.gae import compute_gae, terminal_rewards

Rewards = npt.NDArray[np.float32]
GroupIds = npt.NDArray[np.int64]


def _groups(
    rewards: Rewards, group_ids: GroupIds
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.intp], npt.NDArray[np.float64]]:
    """Rewards in float64, each sample's dense group index, and the size of each group."""
    _, group = np.unique(group_ids, return_inverse=True)
    group = group.reshape(-1)
    return rewards.astype(np.float64), group, np.bincount(group).astype(np.float64)


def _whiten(x: npt.NDArray[np.float64], eps: float) -> npt.NDArray[np.float64]:
    """(x - mean) / (std + eps) over all of x, with the unbiased std (0 for one element)."""
    centred = x - x.mean()
    std = float(np.std(x, ddof=1)) if len(x) > 1 else 0.0
    out: npt.NDArray[np.float64] = centred / (std + eps)
    return out


class GRPOAdvantage:
    """Group-relative advantage: (r - mean(group)) / (std(group) + eps), std optional."""

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config

    def __call__(self, rewards: Rewards, group_ids: GroupIds) -> Rewards:
        r, group, count = _groups(rewards, group_ids)
        mean = np.bincount(group, weights=r) / count
        adv = r - mean[group]
        if self.config.normalize_std:
            # Unbiased std, as in the GRPO paper and TRL; 0 for a group of one.
            sq = np.bincount(group, weights=adv**2)
            std = np.sqrt(sq / np.maximum(count - 1, 1)) * (count > 1)
            adv = adv / (std[group] + self.config.eps)
        return adv.astype(np.float32)


class RLOOAdvantage:
    """REINFORCE leave-one-out: r_i minus the mean reward of the *other* samples of its group.

    The baseline is independent of r_i, so the gradient stays unbiased; equal to
    n/(n-1) * (r_i - mean(group)). A group of one has no baseline and gets 0.
    """

    def __init__(self, config: RLOOConfig) -> None:
        self.config = config

    def __call__(self, rewards: Rewards, group_ids: GroupIds) -> Rewards:
        r, group, count = _groups(rewards, group_ids)
        total = np.bincount(group, weights=r)
        n = count[group]
        others = np.divide(total[group] - r, n - 1, out=np.zeros_like(r), where=n > 1)
        return np.where(n > 1, r - others, 0.0).astype(np.float32)


class ReinforcePPAdvantage:
    """REINFORCE++: rewards whitened over the whole batch (global, not per-group, statistics).

    With ``baseline``, each reward first loses its group mean (REINFORCE++-baseline), which removes
    the prompt's difficulty before the batch-level scaling.
    """

    def __init__(self, config: ReinforcePPConfig) -> None:
        self.config = config

    def __call__(self, rewards: Rewards, group_ids: GroupIds) -> Rewards:
        r, group, count = _groups(rewards, group_ids)
        if self.config.baseline:
            r = r - (np.bincount(group, weights=r) / count)[group]
        return _whiten(r, self.config.eps).astype(np.float32)


class GAEAdvantage:
    """Generalised advantage estimation (PPO with a critic). Needs a value model.

    Unlike the group estimators it works per token (its spec declares `needs_values`):
    `token_advantages` takes the sequences' rewards and the critic's per-token values and returns
    per-token advantages and return targets (see `compute_gae`). Called like the per-sample
    estimators, it raises: without values there is nothing to estimate.
    """

    def __init__(self, config: GAEConfig) -> None:
        self.config = config

    def __call__(self, rewards: Rewards, group_ids: GroupIds) -> Rewards:
        raise TypeError(
            "advantage 'gae' needs a value model: call token_advantages() with the critic's "
            "per-token values instead of the per-sample interface"
        )

    def token_advantages(
        self,
        rewards: Rewards,
        values: npt.NDArray[np.float32],
        offsets: npt.NDArray[np.int64],
        mask: npt.NDArray[np.float32],
        token_penalty: npt.NDArray[np.floating[Any]] | None = None,
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Each sequence's reward lands on its last trained token; `token_penalty` (e.g. the KL
        to the reference, times its coefficient) is subtracted from every token's reward."""
        token_rewards = terminal_rewards(rewards, offsets, mask)
        if token_penalty is not None:
            token_rewards = (token_rewards - token_penalty * mask).astype(np.float32)
        return compute_gae(token_rewards, values, offsets, mask, self.config.gamma, self.config.lam)
