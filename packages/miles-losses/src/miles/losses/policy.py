"""Policy and auxiliary losses. Each returns per-token loss and per-token metrics (`PolicyLoss`).

The trainer multiplies both by `loss_weights` and sums, so nothing here aggregates: a loss only
says what each token contributes. Metrics are computed without gradient.
"""

from __future__ import annotations

import torch

from miles.core.contracts.protocols import LossInputs
from miles.losses.configs import CISPOConfig, GSPOConfig, PPOClipConfig, SFTConfig, ValueConfig

Output = tuple[torch.Tensor, dict[str, torch.Tensor]]

# exp() of a log-ratio beyond this is a numerical accident, never a signal.
_MAX_LOG_RATIO = 20.0


def seq_mean(values: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over each sequence's masked tokens, one entry per sequence ([S])."""
    n = int(seq_index.max()) + 1 if seq_index.numel() else 0
    sums = values.new_zeros(n).index_add(0, seq_index, values * mask)
    counts = mask.new_zeros(n).index_add(0, seq_index, mask)
    return sums / counts.clamp(min=1.0)


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate -min(ratio*A, clip(ratio)*A), and where the clip is active
    (the clipped branch was chosen and differs, so the token's gradient is zero)."""
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - low, 1.0 + high) * adv
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


class PPOClipLoss:
    """PPO's clipped surrogate with asymmetric bounds (clip-higher) and optional dual-clip.

    Dual-clip (Ye et al. 2020) bounds the loss of a negative-advantage token by dual_clip * |A|:
    without it, a token whose ratio has grown large keeps an unbounded push downwards.
    """

    def __init__(self, config: PPOClipConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> Output:
        log_ratio = inputs.logprobs - inputs.old_logprobs
        ratio = torch.exp(log_ratio)
        adv = inputs.advantages
        loss, clipped = _clipped_surrogate(ratio, adv, self.config.clip_low, self.config.clip_high)
        metrics: dict[str, torch.Tensor] = {}
        if self.config.dual_clip is not None:
            bound = -self.config.dual_clip * adv
            dual = (adv < 0) & (bound < loss)
            loss = torch.where(dual, bound, loss)
            metrics["train/dual_clipfrac"] = dual.float()
        metrics["train/ppo_kl"] = -log_ratio.detach()  # k1 estimate of KL(old || new)
        metrics["train/clipfrac"] = clipped
        return loss, metrics


class GSPOLoss:
    """Group Sequence Policy Optimization (Zheng et al. 2025), in its GSPO-token form.

    The importance ratio is per sequence, s_i = exp(mean over its masked tokens of log(pi/pi_old)),
    clipped as a whole, so a few off tokens cannot veto or inflate a sequence's update. The
    token form's ratio sg(s_i) * pi(t) / sg(pi(t)) has the value s_i and, for a sequence-constant
    advantage, GSPO's gradient, while still allowing per-token advantages.
    """

    def __init__(self, config: GSPOConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> Output:
        if inputs.seq_index is None:
            raise ValueError("gspo needs LossInputs.seq_index (each token's sequence)")
        lp = inputs.logprobs
        log_ratio = lp - inputs.old_logprobs
        with torch.no_grad():
            seq_log_ratio = seq_mean(log_ratio, inputs.seq_index, inputs.loss_mask)
            seq_log_ratio = seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        ratio = torch.exp(seq_log_ratio[inputs.seq_index] + lp - lp.detach())
        loss, clipped = _clipped_surrogate(
            ratio, inputs.advantages, self.config.clip_low, self.config.clip_high
        )
        return loss, {"train/ppo_kl": -log_ratio.detach(), "train/clipfrac": clipped}


class CISPOLoss:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, 2025): -sg(w) * A * log pi.

    w = clip(ratio, 1 - clip_low, 1 + clip_high) is a detached coefficient on the REINFORCE term,
    so a clipped token is down-weighted rather than dropped: rare, pivotal tokens keep a gradient.
    """

    def __init__(self, config: CISPOConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> Output:
        log_ratio = (inputs.logprobs - inputs.old_logprobs).detach()
        ratio = torch.exp(log_ratio.clamp(max=_MAX_LOG_RATIO))
        low = None if self.config.clip_low is None else 1.0 - self.config.clip_low
        weight = torch.clamp(ratio, min=low, max=1.0 + self.config.clip_high)
        loss = -weight * inputs.advantages * inputs.logprobs
        return loss, {"train/ppo_kl": -log_ratio, "train/clipfrac": (weight != ratio).float()}


class SFTLoss:
    """Negative log-likelihood of the masked tokens: warm-starts and distillation."""

    def __init__(self, config: SFTConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> Output:
        return -inputs.logprobs, {}


class ValueLoss:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2).

    Reads `values` (the critic's, with gradient), `old_values` and `returns` from `LossInputs`.
    """

    def __init__(self, config: ValueConfig) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> Output:
        v, returns = inputs.values, inputs.returns
        if v is None or returns is None:
            raise ValueError("the value loss needs LossInputs.values and LossInputs.returns")
        err = (v - returns).square()
        if self.config.clip is None:
            return 0.5 * err, {"train/value_error": err.detach()}
        if inputs.old_values is None:
            raise ValueError("a clipped value loss needs LossInputs.old_values")
        c = self.config.clip
        moved = v - inputs.old_values
        err_clipped = (inputs.old_values + torch.clamp(moved, -c, c) - returns).square()
        loss = 0.5 * torch.maximum(err, err_clipped)
        # Active only for values that moved past the bound (inside it the two errors are equal up
        # to rounding).
        clipped = (moved.detach().abs() > c) & (err_clipped > err)
        metrics = {"train/value_error": err.detach(), "train/value_clipfrac": clipped.float()}
        return loss, metrics
