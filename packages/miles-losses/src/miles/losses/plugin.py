"""miles-losses' plugin module: the components it registers."""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import ComponentSpec, Kind, hookimpl, lazy
from miles.losses.configs import GRPOConfig, PPOClipConfig, SFTConfig


@hookimpl
def miles_register_advantages() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.ADVANTAGE,
            "grpo",
            lazy("miles.losses.advantages:GRPOAdvantage"),
            "group-relative advantage; normalize_std: false gives Dr.GRPO",
            GRPOConfig,
        ),
    ]


@hookimpl
def miles_register_losses() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.LOSS,
            "ppo_clip",
            lazy("miles.losses.policy:PPOClipLoss"),
            "PPO clipped surrogate with asymmetric (clip-higher) bounds",
            PPOClipConfig,
        ),
        ComponentSpec(
            Kind.LOSS,
            "sft",
            lazy("miles.losses.policy:SFTLoss"),
            "negative log-likelihood of masked tokens (warm-starts, distillation)",
            SFTConfig,
        ),
    ]


@hookimpl
def miles_register_kl_estimators() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(Kind.KL, name, lazy(f"miles.losses.kl:{name}"), summary)
        for name, summary in [
            ("k1", "log(pi/pi_ref): unbiased, high variance"),
            ("k2", "0.5*log(pi/pi_ref)^2: low variance, biased"),
            ("k3", "pi_ref/pi - 1 - log(pi_ref/pi): unbiased, non-negative"),
        ]
    ]
