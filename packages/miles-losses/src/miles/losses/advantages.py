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
        out = np.zeros_like(rewards, dtype=np.float32)
        for gid in np.unique(group_ids):
            idx = group_ids == gid
            r = rewards[idx].astype(np.float64)
            adv = r - r.mean()
            if self.config.normalize_std:
                # Unbiased std, as in the GRPO paper and TRL.
                std = r.std(ddof=1) if len(r) > 1 else 0.0
                adv = adv / (std + self.config.eps)
            out[idx] = adv
        return out
