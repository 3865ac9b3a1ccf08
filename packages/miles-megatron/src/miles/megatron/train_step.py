"""What a train step adds to the pipeline schedule: each micro-batch's policy loss and its metrics
as loss-weighted sums, their reduction over the ranks, and the optimizer step (clipped by Miles,
skipped on a non-finite grad norm), as fsdp's train step does.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from miles.core.contracts.protocols import PolicyLoss
from miles.core.contracts.types import PackedBatch
from miles.megatron.optimizer_state import optimizers
from miles.torch.train.microbatch import MicroBatch, loss_inputs

# The metrics the trainer reports itself: a loss's metric may not take these names.
TRAINER_METRICS = ("train/loss", "train/entropy", "train/grad_norm", "train/lr")


class MicroBatchLoss:
    """The `loss_of` of a train step's schedule: the weighted policy loss of a micro-batch, and
    the loss-weighted sums of "train/loss", "train/entropy" and the loss's metrics, in `keys`'
    order (set by the first micro-batch; only last-stage ranks see any)."""

    def __init__(
        self,
        batch: PackedBatch,
        weights: npt.NDArray[np.float32],
        loss: PolicyLoss,
        device: torch.device,
    ) -> None:
        self.batch, self.weights, self.loss, self.device = batch, weights, loss, device
        self.keys: list[str] = []

    def __call__(self, mb: MicroBatch, result: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        lp, entropy = result[0], result[1]
        inputs = loss_inputs(self.batch, self.weights, mb, lp, entropy, self.device)
        token_loss, metrics = self.loss(inputs)
        w = inputs.loss_weights
        sums = {"train/loss": token_loss, "train/entropy": entropy}
        for key, value in metrics.items():
            key = key if key.startswith("train/") else f"train/{key}"
            if key in TRAINER_METRICS:
                raise ValueError(f"loss metric {key!r} clashes with the trainer's own")
            sums[key] = value
        if not self.keys:
            self.keys.extend(sorted(sums))
        reported = torch.stack([(sums[k].detach().float() * w).sum() for k in self.keys])
        return (token_loss * w).sum(), {"sums": reported}


def reduce_metrics(
    reports: list[dict[str, Any]],
    keys: list[str],
    weights: npt.NDArray[np.float32],
    *,
    tp_rank: int,
    world_size: int,
    device: torch.device,
) -> dict[str, float]:
    """Loss-weighted sums from tensor rank 0 of each data-parallel rank's last stage, summed
    over the world; every metric but the loss becomes a loss-weighted mean. Only last-stage
    ranks know the loss's metric names: they travel too."""
    if world_size > 1:
        everyone: list[list[str] | None] = [None] * world_size
        dist.all_gather_object(everyone, keys)
        keys = next((k for k in everyone if k), [])
    totals = torch.zeros(len(keys), dtype=torch.float32, device=device)
    if tp_rank == 0:
        for r in reports:
            totals += r["sums"].to(device)
    if world_size > 1:
        dist.all_reduce(totals)
    total_weight = float(np.sum(weights, dtype=np.float64)) or 1.0
    return {
        k: float(v) / (1.0 if k == "train/loss" else total_weight)
        for k, v in zip(keys, totals.tolist(), strict=True)
    }


def optimizer_step(ddp: Any, optimizer: Any, grad_clip: float) -> float:
    """The grad norm (before clipping); clips and steps only when it is finite. Gradients are
    zeroed either way."""
    optimizer.prepare_grads()
    grad_norm = float(optimizer.get_grad_norm())
    if math.isfinite(grad_norm):
        if grad_clip > 0 and grad_norm > grad_clip:  # megatron-core's factor, from the norm
            coeff = grad_clip / (grad_norm + 1.0e-6)
            grads = [p.grad for opt in optimizers(optimizer) for p in opt.get_parameters()]
            torch._foreach_mul_([g for g in grads if g is not None], coeff)
        optimizer.step_with_ready_grads()
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    return grad_norm
