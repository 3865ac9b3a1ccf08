"""The train rank's batch logic (`Algorithm.prepare`), without Ray or a model: what the batch
carries into the train step, from rewards, logprobs and the run's algorithm settings."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from miles.core.config import AlgorithmConfig, ComponentRef, KLSettings
from miles.core.contracts.algorithm import Algorithm
from miles.core.contracts.backends import LogprobResult
from miles.core.contracts.types import PackedBatch, Sample

F32 = np.float32


def batch() -> PackedBatch:
    """Two groups of two; prompts of 2 tokens, responses of 2 and 3."""
    samples = [
        Sample([1, 2], [3, 4], [-1.0, -1.0], reward=1.0, group_id=0, sample_id=0),
        Sample([1, 2], [5, 6, 7], [-1.0, -1.0, -1.0], reward=0.0, group_id=0, sample_id=1),
        Sample([1, 2], [3, 4], [-1.0, -1.0], reward=0.5, group_id=1, sample_id=2),
        Sample([1, 2], [5, 6, 7], [-1.0, -1.0, -1.0], reward=0.5, group_id=1, sample_id=3),
    ]
    return PackedBatch.from_samples(samples)


def mean_baseline(rewards: Any, group_ids: Any) -> Any:
    """Reward minus its group's mean: a fake estimator with numbers easy to check."""
    out = rewards.astype(np.float64).copy()
    for g in np.unique(group_ids):
        out[group_ids == g] -= rewards[group_ids == g].mean()
    return out.astype(F32)


def no_loss(inputs: Any) -> Any:
    raise AssertionError("prepare never calls the loss")


def out_for(b: PackedBatch, shift: float = 0.0, ref: float | None = None) -> LogprobResult:
    lp = np.where(b.loss_mask > 0, b.rollout_logprobs + shift, 0.0).astype(F32)
    reference = None if ref is None else np.where(b.loss_mask > 0, ref, 0.0).astype(F32)
    return LogprobResult(lp, np.zeros_like(lp), reference, {"moe/routing_agreement": 0.9})


def test_advantages_loss_weights_and_old_logprobs() -> None:
    b = batch()
    algo = Algorithm(AlgorithmConfig(), no_loss, advantage=mean_baseline)
    metrics = algo.prepare(b, out_for(b, shift=-0.1))
    # Each sample's advantage on its response tokens, 0 on prompts.
    want = np.array([0, 0, 0.5, 0.5, 0, 0, -0.5, -0.5, -0.5, 0, 0, 0, 0, 0, 0, 0, 0, 0], F32)
    np.testing.assert_allclose(b.advantages, want)
    # token_mean over the 10 trained tokens of the whole batch.
    np.testing.assert_allclose(b.loss_weights, b.loss_mask / 10)
    np.testing.assert_allclose(b.old_logprobs[b.loss_mask > 0], -1.1, rtol=1e-6)
    assert metrics["train/rollout_logprob_abs_diff"] == pytest.approx(0.1, rel=1e-5)
    assert metrics["moe/routing_agreement"] == 0.9  # the backend's own metrics pass through
    assert metrics["train/advantage_abs_mean"] == pytest.approx(0.25)
    assert metrics["train/is_clipfrac"] == 0.0


def test_old_logprobs_from_the_rollout_and_sequence_aggregation() -> None:
    b = batch()
    config = AlgorithmConfig(old_logprobs="rollout", aggregation="seq_mean_token_mean")
    Algorithm(config, no_loss, advantage=mean_baseline).prepare(b, out_for(b, shift=-0.1))
    np.testing.assert_array_equal(b.old_logprobs, b.rollout_logprobs)
    # Each of the 4 sequences weighs 1/4, spread over its own trained tokens.
    per_token = np.repeat([1 / 8, 1 / 12, 1 / 8, 1 / 12], b.seq_lens) * b.loss_mask
    np.testing.assert_allclose(b.loss_weights, per_token, rtol=1e-6)


def test_a_kl_reward_penalty_lowers_the_rewards_before_advantages() -> None:
    b = batch()
    config = AlgorithmConfig(kl=KLSettings(coef=0.5, mode="reward"))
    seen: list[Any] = []

    def kl(lp: Any, ref: Any) -> Any:
        seen.append(type(lp))
        return lp - ref  # k1, on numpy arrays

    algo = Algorithm(config, no_loss, advantage=lambda r, g: r.copy(), kl=kl)
    metrics = algo.prepare(b, out_for(b, ref=-1.2))  # kl = 0.2 per trained token
    assert seen == [np.ndarray]
    penalties = 0.5 * 0.2 * b.seq_lens.astype(float) - 0.5 * 0.2 * 2  # response tokens only
    np.testing.assert_allclose(b.advantages[[2, 6, 11, 15]], (b.rewards - penalties), rtol=1e-5)
    assert metrics["train/kl_reward_penalty"] == pytest.approx(penalties.mean(), rel=1e-5)
    with pytest.raises(ValueError, match="reference logprobs"):
        algo.prepare(batch(), out_for(batch()))


def test_a_correction_masks_tokens_and_weighs_the_rest() -> None:
    b = batch()

    def correction(old: Any, rollout: Any, mask: Any, seq: Any) -> Any:
        keep = np.ones_like(mask)
        keep[seq == 1] = 0  # drop the second sequence
        return np.full_like(mask, 2.0), keep, {"train/is_clipfrac": 0.3}

    algo = Algorithm(AlgorithmConfig(), no_loss, advantage=mean_baseline, correction=correction)
    metrics = algo.prepare(b, out_for(b))
    assert b.loss_mask.sum() == 7  # 10 trained tokens minus the 3 of sequence 1
    # token_mean over the 7 kept tokens, times the importance weight.
    np.testing.assert_allclose(b.loss_weights, 2.0 * b.loss_mask / 7, rtol=1e-6)
    assert metrics["train/is_clipfrac"] == 0.3


def test_a_critic_gives_per_token_advantages_and_returns() -> None:
    b = batch()
    calls: list[Any] = []

    class TokenGAE:
        def token_advantages(
            self, rewards: Any, values: Any, offsets: Any, mask: Any, penalty: Any = None
        ) -> Any:
            calls.append(penalty)
            return (mask * 3.0).astype(F32), (mask * 4.0).astype(F32)

    algo = Algorithm(
        AlgorithmConfig(value_loss=ComponentRef("value")),
        no_loss,
        token_advantage=TokenGAE(),
        value_loss=no_loss,
    )
    values = np.full(len(b.tokens), 0.25, F32)
    metrics = algo.prepare(b, out_for(b), values=lambda: values)
    np.testing.assert_array_equal(b.advantages, b.loss_mask * 3.0)
    np.testing.assert_array_equal(b.returns, b.loss_mask * 4.0)
    np.testing.assert_array_equal(b.values, values)
    assert calls == [None] and metrics["critic/values_mean"] == 0.25
    with pytest.raises(ValueError, match="critic's values"):
        algo.prepare(batch(), out_for(batch()))
