"""Train–inference mismatch corrections: importance weights and masks per token.

The rollout engine samples with its own kernels (and maybe a lower precision), so the trainer's
probability of a sampled token under the *same* weights differs from the engine's. With
ratio = exp(old_logprobs - rollout_logprobs) = pi_train / pi_infer, a correction returns

    weights [T]  multiply the per-token loss (importance sampling),
    keep    [T]  0/1, drop tokens whose mismatch is too large to trust,
    metrics      scalars over the masked tokens: train/is_ratio_mean, train/is_clipfrac (tokens
                 whose weight was truncated or that were dropped), train/ess_ratio (effective
                 sample size over n: (sum w)^2 / (n * sum w^2), 1 when all weights are equal).

"sequence" level uses one ratio per sequence, the product of its masked tokens' ratios.

The run calls a correction with numpy arrays (it needs no gradient) and gets numpy arrays and
float metrics back; on torch tensors it answers in tensors.
"""

from __future__ import annotations

import abc
import math
from typing import Any, Protocol

import numpy as np
import torch

from miles.losses.configs import IcePopConfig, Level, MISConfig, TISConfig

Metrics = dict[str, torch.Tensor]
CorrectionOutput = tuple[torch.Tensor, torch.Tensor, Metrics]

# Bounds the exponent of a ratio: exp(+-20) is already far past any cap or mask bound.
_MAX_LOG_RATIO = 20.0


class Correction(Protocol):
    def __call__(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        seq_index: torch.Tensor | None,
    ) -> CorrectionOutput: ...


class _OnArrays(abc.ABC):
    """numpy in, numpy (and float metrics) out; torch in, torch out."""

    def __call__(
        self, old_logprobs: Any, rollout_logprobs: Any, loss_mask: Any, seq_index: Any
    ) -> Any:
        if not isinstance(old_logprobs, np.ndarray):
            return self.correct(old_logprobs, rollout_logprobs, loss_mask, seq_index)
        weights, keep, metrics = self.correct(
            torch.from_numpy(np.asarray(old_logprobs)),
            torch.from_numpy(np.asarray(rollout_logprobs)),
            torch.from_numpy(np.asarray(loss_mask)),
            None if seq_index is None else torch.from_numpy(np.asarray(seq_index)),
        )
        return weights.numpy(), keep.numpy(), {k: float(v) for k, v in metrics.items()}

    @abc.abstractmethod
    def correct(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        seq_index: torch.Tensor | None,
    ) -> CorrectionOutput: ...


def log_ratios(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq_index: torch.Tensor | None,
    level: Level,
) -> torch.Tensor:
    """log(pi_train / pi_infer) per token, or its sum over the token's sequence ("sequence")."""
    log_ratio = (old_logprobs - rollout_logprobs).detach() * loss_mask
    if level == "token":
        return log_ratio
    if seq_index is None:
        raise ValueError("a sequence-level correction needs each token's sequence (seq_index)")
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    return log_ratio.new_zeros(n).index_add(0, seq_index, log_ratio)[seq_index]


def correction_metrics(
    log_ratio: torch.Tensor,
    weights: torch.Tensor,
    keep: torch.Tensor,
    changed: torch.Tensor,
    loss_mask: torch.Tensor,
) -> Metrics:
    """The three metrics every correction reports, over the masked tokens."""
    mask = loss_mask > 0
    n = mask.sum().clamp(min=1).to(weights.dtype)
    ratio = torch.exp(log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    w = torch.where(mask, weights * keep, torch.zeros_like(weights))
    sq = w.square().sum()
    ess = torch.where(sq > 0, w.sum().square() / (n * sq.clamp(min=1e-30)), torch.zeros_like(sq))
    return {
        "train/is_ratio_mean": (ratio * mask).sum() / n,
        "train/is_clipfrac": (changed & mask).sum().to(weights.dtype) / n,
        "train/ess_ratio": ess,
    }


class TIS(_OnArrays):
    """Truncated importance sampling: weight min(ratio, cap), keeps every token.

    Token level follows Yao et al. 2025 ("Your efficient RL framework secretly brings you
    off-policy RL training"); sequence level truncates the product of the sequence's ratios.
    """

    def __init__(self, config: TISConfig) -> None:
        self.config = config

    def correct(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        seq_index: torch.Tensor | None,
    ) -> CorrectionOutput:
        lr = log_ratios(old_logprobs, rollout_logprobs, loss_mask, seq_index, self.config.level)
        log_cap = math.log(self.config.cap)
        weights = torch.exp(lr.clamp(-_MAX_LOG_RATIO, log_cap))
        keep = torch.ones_like(weights)
        return weights, keep, correction_metrics(lr, weights, keep, lr > log_cap, loss_mask)


def _masked_is(
    lr: torch.Tensor, low: float, high: float, loss_mask: torch.Tensor
) -> CorrectionOutput:
    """Weight = ratio inside [low, high]; outside, weight 0 and keep 0."""
    log_low = math.log(low) if low > 0 else -math.inf
    inside = (lr >= log_low) & (lr <= math.log(high))
    keep = inside.to(lr.dtype)
    weights = torch.exp(lr.clamp(-_MAX_LOG_RATIO, math.log(high))) * keep
    return weights, keep, correction_metrics(lr, weights, keep, ~inside, loss_mask)


class MIS(_OnArrays):
    """Masked importance sampling: IS weight = ratio where it lies in [low, high]; tokens (or
    whole sequences, at "sequence" level) outside are dropped (keep = 0) instead of truncated."""

    def __init__(self, config: MISConfig) -> None:
        self.config = config

    def correct(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        seq_index: torch.Tensor | None,
    ) -> CorrectionOutput:
        lr = log_ratios(old_logprobs, rollout_logprobs, loss_mask, seq_index, self.config.level)
        return _masked_is(lr, self.config.low, self.config.high, loss_mask)


class IcePop(_OnArrays):
    """IcePop (Ring-1T, Ling Team 2025): the token-level mask M(k) = k if low <= k <= high else 0
    on k = pi_train / pi_infer, with the paper's bounds [0.5, 5] by default."""

    def __init__(self, config: IcePopConfig) -> None:
        self.config = config

    def correct(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        loss_mask: torch.Tensor,
        seq_index: torch.Tensor | None,
    ) -> CorrectionOutput:
        lr = log_ratios(old_logprobs, rollout_logprobs, loss_mask, seq_index, "token")
        return _masked_is(lr, self.config.low, self.config.high, loss_mask)
