"""Policy losses. Each returns per-token loss and per-token metrics (see `PolicyLoss`)."""

from __future__ import annotations

import torch

from miles.core.protocols import LossInputs
from miles.losses.configs import PPOClipConfig, SFTConfig


class PPOClipLoss:
    """PPO's clipped surrogate with asymmetric bounds (clip-higher)."""

    def __init__(self, config: PPOClipConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        log_ratio = inputs.logprobs - inputs.old_logprobs
        ratio = torch.exp(log_ratio)
        adv = inputs.advantages
        clipped = torch.clamp(ratio, 1.0 - self.config.clip_low, 1.0 + self.config.clip_high)
        loss = -torch.minimum(ratio * adv, clipped * adv)
        with torch.no_grad():
            metrics = {
                "train/ppo_kl": -log_ratio,  # k1 estimate of KL(old || new)
                "train/clipfrac": ((ratio - clipped).abs() > 0).float(),
            }
        return loss, metrics


class SFTLoss:
    """Negative log-likelihood of the masked tokens: warm-starts and distillation."""

    def __init__(self, config: SFTConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return -inputs.logprobs, {}
