"""KL estimators between the policy and a reference, per token (Schulman's k1, k2, k3, and
verl's clamped low_var_kl).

Each takes (logprobs, ref_logprobs) of tokens sampled from pi and returns a per-token estimate:
torch tensors inside a loss (differentiable), or numpy arrays for a reward penalty
(`algorithm.kl.mode: reward`); the result has the input's type.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

TensorFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class KLEstimator:
    """A per-token estimate, on torch tensors or numpy arrays alike."""

    def __init__(self, fn: TensorFn) -> None:
        self.fn = fn

    def __call__(self, logprobs: Any, ref_logprobs: Any) -> Any:
        if isinstance(logprobs, np.ndarray):
            out = self.fn(torch.from_numpy(logprobs), torch.from_numpy(np.asarray(ref_logprobs)))
            return out.numpy()
        return self.fn(logprobs, ref_logprobs)


def k1() -> KLEstimator:
    return KLEstimator(lambda lp, ref: lp - ref)


def k2() -> KLEstimator:
    return KLEstimator(lambda lp, ref: 0.5 * (lp - ref).square())


def _k3(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    # Clamp the exponent so one outlier token cannot overflow.
    neg = torch.clamp(ref - lp, max=20.0)
    return torch.exp(neg) - 1.0 - neg


def k3() -> KLEstimator:
    return KLEstimator(_k3)


def _low_var_kl(lp: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    neg = torch.clamp(ref - lp, -20.0, 20.0)
    return torch.clamp(torch.exp(neg) - 1.0 - neg, -10.0, 10.0)


def low_var_kl() -> KLEstimator:
    """k3 with the exponent clamped to [-20, 20] and the estimate to [-10, 10], as in verl: one
    token far off the reference cannot dominate the KL term's gradient."""
    return KLEstimator(_low_var_kl)
