"""What a policy step and a critic step share: loss-weighted metric sums, reduced over ranks,
and the clipped optimizer step that skips a non-finite gradient."""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from miles.torch.train.optim import clip_grad_norm_, set_lr


class MetricSums:
    """Loss-weighted sums of per-token metrics over this rank's micro-batches."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, key: str, value: torch.Tensor, weights: torch.Tensor) -> None:
        total = (value.detach().float() * weights).sum()
        self.sums[key] = self.sums[key] + total if key in self.sums else total

    def reduce(
        self, weights: npt.NDArray[np.float32], loss_key: str, world_size: int
    ) -> dict[str, float]:
        """All-reduce the sums (collective); every metric but the loss (already a weighted sum
        of the global objective) becomes a loss-weighted mean over the whole batch."""
        keys = sorted(self.sums)
        totals = torch.stack([self.sums[k] for k in keys])
        if world_size > 1:
            dist.all_reduce(totals)
        total_weight = float(np.sum(weights, dtype=np.float64)) or 1.0
        return {
            k: float(v) / (1.0 if k == loss_key else total_weight)
            for k, v in zip(keys, totals.tolist(), strict=True)
        }


def optimizer_step(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    lr: float,
    grad_clip: float,
) -> float:
    """Clip, then step at `lr` unless the grad norm is non-finite; returns the grad norm."""
    grad_norm = clip_grad_norm_(params, grad_clip)
    if math.isfinite(grad_norm):
        set_lr(optimizer, lr)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm
