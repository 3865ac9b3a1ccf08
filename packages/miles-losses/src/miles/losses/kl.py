"""KL estimators between the policy and a reference, per token (Schulman's k1, k2, k3, and
verl's clamped low_var_kl)."""

from __future__ import annotations

from collections.abc import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# Each takes (logprobs, ref_logprobs) of tokens sampled from pi and returns a per-token estimate.
def k1() -> KLEstimator:
    return lambda lp, ref: lp - ref


def k2() -> KLEstimator:
    return lambda lp, ref: 0.5 * (lp - ref).square()


def k3() -> KLEstimator:
    def estimate(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        # Clamp the exponent so one outlier token cannot overflow.
        neg = torch.clamp(ref - lp, max=20.0)
        return torch.exp(neg) - 1.0 - neg

    return estimate


def low_var_kl() -> KLEstimator:
    """k3 with the exponent clamped to [-20, 20] and the estimate to [-10, 10], as in verl: one
    token far off the reference cannot dominate the KL term's gradient."""

    def estimate(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
        neg = torch.clamp(ref - lp, -20.0, 20.0)
        return torch.clamp(torch.exp(neg) - 1.0 - neg, -10.0, 10.0)

    return estimate
