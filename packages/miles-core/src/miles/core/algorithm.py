"""Turning rewards into what the loss needs: advantages per token, loss weights, a KL term.

Loss weights fold the loss mask and the aggregation over the *global* batch into one number per
token, so any split into micro-batches and data-parallel ranks sums to the one-shot value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from miles.core.protocols import LossInputs, PolicyLoss
from miles.core.types import PackedBatch

if TYPE_CHECKING:
    import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def token_seq_index(batch: PackedBatch) -> npt.NDArray[np.int64]:
    return np.repeat(np.arange(len(batch), dtype=np.int64), batch.seq_lens)


def spread_advantages(batch: PackedBatch, per_sample: npt.NDArray[np.float32]) -> None:
    """Writes each sample's scalar advantage onto its trained tokens."""
    per_token = per_sample[token_seq_index(batch)] * batch.loss_mask
    batch.advantages = np.asarray(per_token, dtype=np.float32)


def loss_weights(
    batch: PackedBatch, aggregation: Aggregation, seq_sum_normalizer: float = 1.0
) -> npt.NDArray[np.float32]:
    mask: npt.NDArray[np.float64] = batch.loss_mask.astype(np.float64)
    if aggregation == "token_mean":
        return (mask / max(float(mask.sum()), 1.0)).astype(np.float32)
    seq = token_seq_index(batch)
    tokens_per_seq = np.bincount(seq, weights=mask, minlength=len(batch))
    # Every sequence counts, also one with no trained token (all tool output, or masked by a
    # correction): a constant denominator, as in Dr.GRPO and TRL.
    n_seqs = max(len(batch), 1)
    if aggregation == "seq_mean_token_mean":
        per_token = 1.0 / np.maximum(tokens_per_seq[seq], 1.0)
        return (mask * per_token / n_seqs).astype(np.float32)
    if aggregation == "seq_mean_token_sum":
        return (mask / (seq_sum_normalizer * n_seqs)).astype(np.float32)
    raise ValueError(f"unknown aggregation {aggregation!r}")


def masked_mean(values: npt.NDArray[Any], mask: npt.NDArray[Any]) -> float:
    total = float(mask.sum())
    return float((values * mask).sum() / total) if total else 0.0


class WithKL:
    """Adds ``coef * KL(pi || pi_ref)`` per token to a policy loss, as a loss term."""

    def __init__(
        self,
        base: PolicyLoss,
        estimator: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        coef: float,
    ) -> None:
        self.base, self.estimator, self.coef = base, estimator, coef

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = self.base(inputs)
        if inputs.ref_logprobs is None:
            raise ValueError("a KL term needs reference logprobs from the train backend")
        kl = self.estimator(inputs.logprobs, inputs.ref_logprobs)
        return loss + self.coef * kl, {**metrics, "train/kl_ref": kl.detach()}


class WithEntropyBonus:
    """Subtracts ``coef * entropy`` per token: a bonus that keeps the policy exploring."""

    def __init__(self, base: PolicyLoss, coef: float) -> None:
        self.base, self.coef = base, coef

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = self.base(inputs)
        return loss - self.coef * inputs.entropy, metrics


def sequence_sums(values: npt.NDArray[Any], batch: PackedBatch) -> npt.NDArray[np.float64]:
    """Per-sequence sums of a per-token array over the trained tokens."""
    masked = np.asarray(values, np.float64) * batch.loss_mask
    sums = np.bincount(token_seq_index(batch), weights=masked, minlength=len(batch))
    return np.asarray(sums, dtype=np.float64)


def mismatch_metrics(
    trainer: npt.NDArray[Any], rollout: npt.NDArray[Any], mask: npt.NDArray[Any]
) -> dict[str, float]:
    """How far the engine's logprobs of the sampled tokens are from the trainer's, before the update.

    ratio = pi_train / pi_rollout per token. ess_ratio = (sum w)^2 / (n * sum w^2) over trained
    tokens: 1 when the two policies agree, falling towards 0 as the importance weights spread.
    """
    diff = np.asarray(trainer, np.float64) - rollout
    ratio = np.exp(np.clip(diff, -20.0, 20.0))
    keep = mask > 0
    n = int(keep.sum())
    w = ratio[keep]
    return {
        "train/rollout_logprob_abs_diff": masked_mean(np.abs(diff), mask),
        # k3 estimate of KL(rollout || train), over the sampled (rollout) tokens.
        "train/rollout_kl": masked_mean(np.exp(diff) - 1 - diff, mask),
        "train/is_ratio_mean": float(w.mean()) if n else 1.0,
        "train/ess_ratio": float(w.sum() ** 2 / (n * (w**2).sum())) if n else 1.0,
    }
