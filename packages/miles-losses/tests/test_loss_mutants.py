"""Exact small cases for the loss components' edges: values the property tests leave loose (error
messages, one-token and two-sample cases, metric values, the optional branches)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from miles.core.contracts.protocols import LossInputs
from miles.losses.advantages import GAEAdvantage, GRPOAdvantage, ReinforcePPAdvantage
from miles.losses.configs import (
    CISPOConfig,
    GAEConfig,
    GRPOConfig,
    GSPOConfig,
    MISConfig,
    PPOClipConfig,
    ReinforcePPConfig,
    SFTConfig,
    TISConfig,
)
from miles.losses.corrections import MIS, TIS, correction_metrics, log_ratios
from miles.losses.gae import terminal_rewards
from miles.losses.policy import CISPOLoss, GSPOLoss, PPOClipLoss, SFTLoss, seq_mean


def _inputs(lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, **extra: object) -> LossInputs:
    ones = torch.ones_like(lp)
    return LossInputs(
        logprobs=lp,
        old_logprobs=old,
        rollout_logprobs=old,
        advantages=adv,
        loss_mask=ones,
        loss_weights=ones / len(ones),
        entropy=ones,
        **extra,  # type: ignore[arg-type]
    )


# ── advantages ──────────────────────────────────────────────────────────────────────────────────


def test_gae_called_per_sample_says_what_to_call_instead() -> None:
    gae = GAEAdvantage(GAEConfig())
    with pytest.raises(TypeError, match=r"token_advantages\(\) with the critic's per-token values"):
        gae(np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.int64))


def test_terminal_reward_of_a_sequence_whose_last_trained_token_is_the_first() -> None:
    # Sequence 0 is one trained token at flat position 0; sequence 1 trains positions 2 and 3;
    # sequence 2 trains nothing and drops its reward.
    offsets = np.array([0, 1, 4, 6])
    mask = np.array([1, 0, 1, 1, 0, 0], dtype=np.float32)
    out = terminal_rewards(np.array([2.0, 3.0, 5.0], dtype=np.float32), offsets, mask)
    assert out.tolist() == [2.0, 0.0, 0.0, 3.0, 0.0, 0.0]


def test_reinforce_pp_whitens_two_samples_with_the_unbiased_std() -> None:
    adv = ReinforcePPAdvantage(ReinforcePPConfig(eps=0.0))(
        np.array([1.0, 3.0], dtype=np.float32), np.array([0, 1])
    )
    np.testing.assert_allclose(adv, [-1 / math.sqrt(2), 1 / math.sqrt(2)], rtol=1e-6)
    one = ReinforcePPAdvantage(ReinforcePPConfig())(
        np.array([4.0], dtype=np.float32), np.array([0])
    )
    assert one.tolist() == [0.0]


# ── policy losses ───────────────────────────────────────────────────────────────────────────────


def test_sft_loss_is_the_negative_log_likelihood() -> None:
    lp = torch.tensor([-0.5, -2.0, -0.1], requires_grad=True)
    loss, metrics = SFTLoss(SFTConfig())(_inputs(lp, lp.detach(), torch.zeros(3)))
    assert loss.tolist() == pytest.approx([0.5, 2.0, 0.1]) and metrics == {}
    loss.sum().backward()  # type: ignore[no-untyped-call]
    assert lp.grad is not None and lp.grad.tolist() == [-1.0, -1.0, -1.0]


def test_dual_clip_metrics_and_bound() -> None:
    # ratios e^1.5 ~ 4.48, e^1.5, 1, e^-1: only token 0 (A < 0, loss 4.48 > 3 * 1) is dual-clipped.
    lp = torch.tensor([0.0, 0.0, 0.0, -1.0])
    old = torch.tensor([-1.5, -1.5, 0.0, 0.0])
    adv = torch.tensor([-1.0, 1.0, -1.0, -1.0])
    loss, metrics = PPOClipLoss(PPOClipConfig(dual_clip=3.0))(_inputs(lp, old, adv))
    assert metrics["train/dual_clipfrac"].tolist() == [1.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(loss, torch.tensor([3.0, -1.2, 1.0, 0.8]))
    _, plain = PPOClipLoss(PPOClipConfig())(_inputs(lp, old, adv))
    assert "train/dual_clipfrac" not in plain


def test_gspo_reports_kl_and_clipfrac() -> None:
    lp = torch.tensor([-1.0, -1.0, -2.0])
    old = torch.tensor([-1.0, -1.5, -2.0])
    seq = torch.tensor([0, 0, 1])
    _, metrics = GSPOLoss(GSPOConfig(0.1, 0.1))(_inputs(lp, old, torch.ones(3), seq_index=seq))
    assert set(metrics) == {"train/ppo_kl", "train/clipfrac"}
    torch.testing.assert_close(metrics["train/ppo_kl"], torch.tensor([0.0, -0.5, 0.0]))
    # Sequence 0's ratio is e^0.25 > 1.1 with A > 0: clipped; sequence 1's is 1.
    assert metrics["train/clipfrac"].tolist() == [1.0, 1.0, 0.0]


def test_cispo_lower_bound_when_set() -> None:
    lp = torch.tensor([-3.0, -1.0, 0.0])
    old = torch.tensor([-1.0, -1.0, -3.0])  # ratios e^-2 ~ 0.135, 1, e^3 ~ 20.1
    adv = torch.tensor([1.0, 1.0, 1.0])
    loss, metrics = CISPOLoss(CISPOConfig(clip_low=0.5, clip_high=1.0))(_inputs(lp, old, adv))
    torch.testing.assert_close(loss, torch.tensor([0.5 * 3.0, 1.0, 0.0]))
    assert metrics["train/clipfrac"].tolist() == [1.0, 0.0, 1.0]
    unbounded, _ = CISPOLoss(CISPOConfig(clip_high=1.0))(_inputs(lp, old, adv))
    torch.testing.assert_close(unbounded[0], torch.tensor(math.exp(-2) * 3.0))


def test_seq_mean_over_masked_tokens() -> None:
    values = torch.tensor([1.0, 3.0, 10.0, 4.0])
    out = seq_mean(values, torch.tensor([0, 0, 1, 2]), torch.tensor([1.0, 1.0, 0.0, 1.0]))
    assert out.tolist() == [2.0, 0.0, 4.0]


# ── mismatch corrections ────────────────────────────────────────────────────────────────────────


def test_correction_metrics_count_only_masked_tokens() -> None:
    log_ratio = torch.tensor([math.log(2.0), 0.0, math.log(4.0), math.log(8.0)])
    weights = torch.tensor([2.0, 1.0, 4.0, 0.0])
    keep = torch.tensor([1.0, 1.0, 1.0, 0.0])
    changed = torch.tensor([False, True, True, True])
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0])  # token 2 is not trained
    metrics = correction_metrics(log_ratio, weights, keep, changed, mask)
    assert float(metrics["train/is_ratio_mean"]) == pytest.approx((2 + 1 + 8) / 3)
    assert float(metrics["train/is_clipfrac"]) == pytest.approx(2 / 3)
    # w over masked tokens: (2, 1, 0): (3)^2 / (3 * 5)
    assert float(metrics["train/ess_ratio"]) == pytest.approx(9 / 15)


def test_sequence_level_needs_seq_index_by_name() -> None:
    x = torch.zeros(2)
    with pytest.raises(
        ValueError, match=r"^a sequence-level correction needs each token's sequence \(seq_index\)$"
    ):
        log_ratios(x, x, torch.ones(2), None, "sequence")


def test_tis_weight_has_a_floor_of_exp_minus_20() -> None:
    old = torch.tensor([-40.0, -1.0])
    rollout = torch.tensor([-5.0, -1.0])  # log-ratio -35: far below any meaningful weight
    weights, keep, _ = TIS(TISConfig())(old, rollout, torch.ones(2), None)
    torch.testing.assert_close(weights, torch.tensor([math.exp(-20.0), 1.0]), rtol=1e-5, atol=0)
    assert keep.tolist() == [1.0, 1.0]


def test_mis_with_no_lower_bound_keeps_every_small_ratio() -> None:
    old = torch.tensor([-30.0, -1.0, 0.0])
    rollout = torch.tensor([-1.0, -1.0, -3.0])  # ratios e^-29, 1, e^3 ~ 20
    weights, keep, metrics = MIS(MISConfig(low=0.0, high=2.0))(old, rollout, torch.ones(3), None)
    assert keep.dtype == weights.dtype == torch.float32  # 0/1 weights, not a bool mask
    assert keep.tolist() == [1.0, 1.0, 0.0]
    want = torch.tensor([math.exp(-20.0), 1.0, 0.0])
    torch.testing.assert_close(weights, want, rtol=1e-5, atol=0)
    assert metrics["train/is_clipfrac"] == pytest.approx(1 / 3)


def test_invalid_configs_name_the_key() -> None:
    with pytest.raises(ValueError, match="clip_high must be positive, got 0"):
        CISPOConfig(clip_high=0.0)
    with pytest.raises(ValueError, match="cap must be positive"):
        TISConfig(cap=-1.0)
    CISPOConfig(clip_high=0.5)  # valid: no error


def test_whitening_divides_by_the_std_plus_eps() -> None:
    # Two rewards 0 and 1: centred ±0.5, unbiased std sqrt(0.5); a large eps shows in the value.
    adv = ReinforcePPAdvantage(ReinforcePPConfig(eps=0.5))(np.array([0.0, 1.0]), np.array([0, 1]))
    assert adv.tolist() == pytest.approx([-0.5 / (0.5**0.5 + 0.5), 0.5 / (0.5**0.5 + 0.5)])


def test_grpo_gives_a_group_of_one_a_zero_advantage_not_nan() -> None:
    adv = GRPOAdvantage(GRPOConfig())(np.array([1.0, 0.0, 1.0]), np.array([0, 1, 1]))
    assert np.isfinite(adv).all() and adv[0] == 0.0
    assert adv[1:].tolist() == pytest.approx([-(0.5**0.5), 0.5**0.5], rel=1e-5)  # ±0.5 / std


def test_a_sequence_level_correction_takes_numpy_arrays() -> None:
    """numpy in (the seq_index too), numpy out: the same weights as torch in."""
    old, rollout = np.array([-1.0, -1.0, -2.0]), np.array([-1.5, -1.5, -2.0])
    mask, seq = np.ones(3), np.array([0, 0, 1])
    tis = TIS(TISConfig(level="sequence", cap=10.0))
    weights, keep, metrics = tis(old, rollout, mask, seq)
    assert isinstance(weights, np.ndarray) and isinstance(metrics["train/is_ratio_mean"], float)
    assert weights.tolist() == pytest.approx([math.e, math.e, 1.0]) and keep.tolist() == [1] * 3
