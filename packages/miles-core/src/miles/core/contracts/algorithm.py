"""Turning rewards into what the loss needs: advantages per token, loss weights, a KL term.

Every train rank runs `Algorithm.prepare` on the same batch (so the batch goes from the rollout
manager to the trainers without a round trip through the controller), between the backend's
logprobs and its train step. Loss weights fold the loss mask and the aggregation over the
*global* batch into one number per token, so any split into micro-batches and data-parallel ranks
sums to the one-shot value. Numpy only: the loss wrappers here pass torch tensors through
without importing torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import numpy.typing as npt

from miles.core.config import AlgorithmConfig
from miles.core.contracts.backends import LogprobResult
from miles.core.contracts.protocols import (
    AdvantageEstimator,
    Correction,
    KLEstimator,
    LossInputs,
    PolicyLoss,
    TokenAdvantageEstimator,
)
from miles.core.contracts.types import PackedBatch

if TYPE_CHECKING:
    import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
F32 = npt.NDArray[np.float32]


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

    def __init__(self, base: PolicyLoss, estimator: KLEstimator, coef: float) -> None:
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


@dataclass
class Algorithm:
    """The run's algorithm components (built once per train rank) and what they do to a batch
    between the backend's logprobs and its train step."""

    config: AlgorithmConfig
    loss: PolicyLoss  # the policy loss, with the KL term and entropy bonus folded in
    advantage: AdvantageEstimator | None = None  # per sample, from rewards
    token_advantage: TokenAdvantageEstimator | None = None  # per token, from a critic's values
    value_loss: PolicyLoss | None = None  # the critic's, with `token_advantage`
    kl: KLEstimator | None = None
    correction: Correction | None = None

    def prepare(
        self, batch: PackedBatch, out: LogprobResult, values: Callable[[], F32] | None = None
    ) -> dict[str, float]:
        """Fills the batch's advantages, loss weights, old and reference logprobs (and values and
        returns, with a critic, from `values()`); returns the step's pre-update metrics."""
        algo = self.config
        trainer_lp = out.logprobs.astype(np.float32)
        batch.ref_logprobs = out.ref_logprobs
        # Before the update: how far the engine's view of the sampled tokens is from the
        # trainer's. 0 up to float error when both run the same weights and numerics.
        metrics = mismatch_metrics(trainer_lp, batch.rollout_logprobs, batch.loss_mask)
        metrics.update(out.metrics)
        token_penalty = None
        if self.kl is not None and algo.kl.mode == "reward":
            if batch.ref_logprobs is None:
                raise ValueError("a KL penalty needs reference logprobs from the train backend")
            kl = np.asarray(self.kl(trainer_lp, batch.ref_logprobs), np.float64)
            token_penalty = algo.kl.coef * kl * batch.loss_mask
            metrics["train/kl_reward_penalty"] = float(sequence_sums(token_penalty, batch).mean())
        if self.token_advantage is not None:
            if values is None:
                raise ValueError("a per-token advantage needs the critic's values")
            self._token_advantages(batch, values(), token_penalty, metrics)
        else:
            assert self.advantage is not None, "an Algorithm needs an advantage estimator"
            rewards = batch.rewards
            if token_penalty is not None:
                rewards = (rewards - sequence_sums(token_penalty, batch)).astype(np.float32)
            advantages = np.asarray(self.advantage(rewards, batch.group_ids), np.float32)
            spread_advantages(batch, advantages)
            metrics["train/advantage_abs_mean"] = float(np.abs(advantages).mean())
        is_weights = self._correct(batch, trainer_lp, metrics)
        batch.loss_weights = loss_weights(batch, algo.aggregation, algo.seq_sum_normalizer)
        if is_weights is not None:
            batch.loss_weights = (batch.loss_weights * is_weights).astype(np.float32)
        old = trainer_lp if algo.old_logprobs == "trainer" else batch.rollout_logprobs
        batch.old_logprobs = old
        return metrics

    def _token_advantages(
        self,
        batch: PackedBatch,
        values: F32,
        token_penalty: npt.NDArray[np.float64] | None,
        metrics: dict[str, float],
    ) -> None:
        """PPO with a critic: per-token advantages and return targets from the critic's values."""
        assert self.token_advantage is not None
        values = np.asarray(values, np.float32)
        advantages, returns = self.token_advantage.token_advantages(
            batch.rewards, values, batch.offsets, batch.loss_mask, token_penalty
        )
        batch.advantages, batch.values, batch.returns = advantages, values, returns
        trained = batch.loss_mask > 0
        metrics["train/advantage_abs_mean"] = float(np.abs(advantages[trained]).mean())
        metrics["critic/values_mean"] = float(values[trained].mean())

    def _correct(
        self, batch: PackedBatch, trainer_lp: F32, metrics: dict[str, float]
    ) -> F32 | None:
        """Applies the mismatch correction: tokens it drops leave the loss mask (and so the
        aggregation's denominator); its importance weights scale each token's loss weight."""
        if self.correction is None:
            metrics["train/is_clipfrac"] = 0.0
            return None
        weights, keep, extra = self.correction(
            trainer_lp, batch.rollout_logprobs, batch.loss_mask, token_seq_index(batch)
        )
        metrics.update({k: float(v) for k, v in extra.items()})
        batch.loss_mask = (batch.loss_mask * np.asarray(keep)).astype(np.float32)
        return np.asarray(weights, np.float32)
