"""Advantage estimators: per-sample rewards to per-sample advantages."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from miles.losses.configs import GRPOConfig


class GRPOAdvantage:
    """Group-relative advantage: (r - mean(group)) / (std(group) + eps), std optional."""

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config

    def __call__(
        self, rewards: npt.NDArray[np.float32], group_ids: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float32]:
        _, group = np.unique(group_ids, return_inverse=True)
        r = rewards.astype(np.float64)
        count = np.bincount(group)
        mean = np.bincount(group, weights=r) / count
        adv = r - mean[group]
        if self.config.normalize_std:
            # Unbiased std, as in the GRPO paper and TRL; 0 for a group of one.
            sq = np.bincount(group, weights=adv**2)
            std = np.sqrt(sq / np.maximum(count - 1, 1)) * (count > 1)
            adv = adv / (std[group] + self.config.eps)
        return adv.astype(np.float32)
