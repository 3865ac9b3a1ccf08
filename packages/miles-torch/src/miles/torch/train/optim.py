"""AdamW, the learning-rate schedule and gradient clipping for sharded (DTensor) parameters."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from miles.torch.train.config import FSDPConfig
from miles.torch.train.host_adamw import HostAdamW


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: FSDPConfig, lr: float | None = None
) -> torch.optim.AdamW:
    """AdamW with the config's hyper-parameters; `lr` (default `cfg.lr`) is the peak LR. With
    `optimizer_offload`, its moments rest in host memory between steps (`HostAdamW`)."""
    kind = HostAdamW if cfg.optimizer_offload else torch.optim.AdamW
    return kind(
        params,
        lr=cfg.lr if lr is None else lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )


def lr_at(cfg: FSDPConfig, step: int, lr: float | None = None) -> float:
    """The learning rate of optimizer step `step` (0-based): warmup, then the schedule.

    A pure function of the step count, so the schedule's whole state is one integer. `lr` (default
    `cfg.lr`) is the peak; the critic passes its own and shares the schedule's shape.
    """
    peak = cfg.lr if lr is None else lr
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        decay = 1.0 - progress
    else:  # cosine
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global grad norm to `max_norm` (if > 0) and return the norm before clipping.

    With FSDP2 the grads are DTensor shards: the local norms combine into the global one through
    `full_tensor()` (an all-reduce), so every rank clips by the same factor.
    """
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if max_norm > 0 and math.isfinite(total.item()):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return float(total.item())
