import numpy as np
import torch

from miles.core.contracts.protocols import LossInputs
from miles.losses.advantages import GRPOAdvantage
from miles.losses.configs import GRPOConfig, PPOClipConfig
from miles.losses.kl import k1, k2, k3
from miles.losses.policy import PPOClipLoss


def test_grpo_advantage_per_group() -> None:
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.5], dtype=np.float32)
    groups = np.array([0, 0, 0, 0, 1, 1])
    adv = GRPOAdvantage(GRPOConfig())(rewards, groups)
    g = np.array([1.0, 0.0, 1.0, 1.0])
    np.testing.assert_allclose(adv[:4], (g - g.mean()) / (g.std(ddof=1) + 1e-6), rtol=1e-6)
    np.testing.assert_allclose(adv[4:], [0.0, 0.0])  # zero-variance group: no signal
    dr = GRPOAdvantage(GRPOConfig(normalize_std=False))(rewards, groups)
    np.testing.assert_allclose(dr[:4], g - g.mean(), rtol=1e-6)


def _inputs(logprobs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor) -> LossInputs:
    ones = torch.ones_like(logprobs)
    return LossInputs(
        logprobs=logprobs,
        old_logprobs=old,
        rollout_logprobs=old,
        advantages=adv,
        loss_mask=ones,
        loss_weights=ones / len(ones),
        entropy=ones,
    )


def test_ppo_clip_matches_reference_formula() -> None:
    lp = torch.tensor([-1.0, -0.5, -2.0, -0.1])
    old = torch.tensor([-1.2, -0.5, -1.0, -0.9])
    adv = torch.tensor([1.0, -1.0, -2.0, 0.5])
    loss, metrics = PPOClipLoss(PPOClipConfig(clip_low=0.2, clip_high=0.28))(_inputs(lp, old, adv))
    ratio = torch.exp(lp - old)
    expected = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    torch.testing.assert_close(loss, expected)
    # Clipped where the clipped branch wins: ratio below the floor with A < 0, above the ceiling
    # with A > 0 (outside the bounds with the other sign, the unclipped branch is the minimum).
    assert metrics["train/clipfrac"].tolist() == [0.0, 0.0, 1.0, 1.0]
    flipped = PPOClipLoss(PPOClipConfig(clip_low=0.2, clip_high=0.28))(_inputs(lp, old, -adv))
    assert flipped[1]["train/clipfrac"].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_kl_estimators() -> None:
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(k1()(lp, ref), lp - ref)
    torch.testing.assert_close(k2()(lp, ref), 0.5 * (lp - ref) ** 2)
    torch.testing.assert_close(k3()(lp, ref), torch.exp(ref - lp) - 1 - (ref - lp))
    assert (k3()(lp, ref) >= 0).all() and k3()(lp, lp).abs().max() == 0
