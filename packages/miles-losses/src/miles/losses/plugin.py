"""miles-losses' plugin module: the components it registers.

Factories are lazy so that listing components imports neither torch nor the loss modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from miles.core import Capability, ComponentSpec, Kind, hookimpl, lazy
from miles.losses.configs import (
    CISPOConfig,
    GAEConfig,
    GRPOConfig,
    GSPOConfig,
    IcePopConfig,
    MISConfig,
    PPOClipConfig,
    ReinforcePPConfig,
    RLOOConfig,
    SFTConfig,
    TISConfig,
    ValueConfig,
)


def _reinforce_pp_baseline(config: ReinforcePPConfig) -> Any:
    """`reinforce_pp` with the group-mean baseline forced on."""
    from miles.losses.advantages import ReinforcePPAdvantage

    return ReinforcePPAdvantage(dataclasses.replace(config, baseline=True))


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
        ComponentSpec(
            Kind.ADVANTAGE,
            "rloo",
            lazy("miles.losses.advantages:RLOOAdvantage"),
            "REINFORCE leave-one-out: reward minus the mean of the group's other rewards",
            RLOOConfig,
        ),
        ComponentSpec(
            Kind.ADVANTAGE,
            "reinforce_pp",
            lazy("miles.losses.advantages:ReinforcePPAdvantage"),
            "REINFORCE++: rewards whitened over the whole batch",
            ReinforcePPConfig,
        ),
        ComponentSpec(
            Kind.ADVANTAGE,
            "reinforce_pp_baseline",
            _reinforce_pp_baseline,
            "REINFORCE++-baseline: group mean subtracted, then whitened over the batch",
            ReinforcePPConfig,
        ),
        ComponentSpec(
            Kind.ADVANTAGE,
            "gae",
            lazy("miles.losses.advantages:GAEAdvantage"),
            "generalised advantage estimation per token; needs a value model (critic)",
            GAEConfig,
            capabilities=frozenset({Capability.NEEDS_VALUES}),
        ),
    ]


@hookimpl
def miles_register_losses() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.LOSS,
            "ppo_clip",
            lazy("miles.losses.policy:PPOClipLoss"),
            "PPO clipped surrogate with asymmetric (clip-higher) bounds and optional dual-clip",
            PPOClipConfig,
        ),
        ComponentSpec(
            Kind.LOSS,
            "gspo",
            lazy("miles.losses.policy:GSPOLoss"),
            "GSPO: clipped sequence-level (geometric-mean) importance ratio, token form",
            GSPOConfig,
        ),
        ComponentSpec(
            Kind.LOSS,
            "cispo",
            lazy("miles.losses.policy:CISPOLoss"),
            "CISPO: REINFORCE weighted by a clipped, detached importance ratio (MiniMax-M1)",
            CISPOConfig,
        ),
        ComponentSpec(
            Kind.LOSS,
            "sft",
            lazy("miles.losses.policy:SFTLoss"),
            "negative log-likelihood of masked tokens (warm-starts, distillation)",
            SFTConfig,
        ),
        ComponentSpec(
            Kind.LOSS,
            "value",
            lazy("miles.losses.policy:ValueLoss"),
            "PPO's clipped value (critic) loss against return targets",
            ValueConfig,
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
            ("low_var_kl", "k3 clamped to [-10, 10] (verl's low_var_kl)"),
        ]
    ]


@hookimpl
def miles_register_corrections() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.CORRECTION,
            "tis",
            lazy("miles.losses.corrections:TIS"),
            "truncated importance sampling, min(pi_train/pi_infer, cap), token or sequence",
            TISConfig,
        ),
        ComponentSpec(
            Kind.CORRECTION,
            "mis",
            lazy("miles.losses.corrections:MIS"),
            "masked importance sampling: drop tokens or sequences whose ratio leaves [low, high]",
            MISConfig,
        ),
        ComponentSpec(
            Kind.CORRECTION,
            "icepop",
            lazy("miles.losses.corrections:IcePop"),
            "IcePop: token ratio kept as weight inside [low, high], masked outside",
            IcePopConfig,
        ),
    ]
