"""KL estimators between the policy and a reference, per token (Schulman's k1, k2, k3)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from miles.core.protocols import LossInputs, PolicyLoss

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


class WithKLPenalty:
    """Adds `coef * KL(pi || pi_ref)` to any policy loss, as a loss term."""

    def __init__(self, base: PolicyLoss, kl: KLEstimator, coef: float) -> None:
        self.base, self.kl, self.coef = base, kl, coef

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss, metrics = self.base(inputs)
        if inputs.ref_logprobs is None:
            raise ValueError("a KL term needs reference logprobs: set train.ref_model: true")
        kl = self.kl(inputs.logprobs, inputs.ref_logprobs)
        metrics = {**metrics, "train/kl_ref": kl.detach()}
        return loss + self.coef * kl, metrics
