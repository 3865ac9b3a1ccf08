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
    n_seqs = max(int((tokens_per_seq > 0).sum()), 1)
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
