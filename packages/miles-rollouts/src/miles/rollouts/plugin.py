"""miles-rollouts' plugin module: the rollout functions and environments it registers."""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import ComponentSpec, Kind, hookimpl
from miles.rollouts.environments import Calculator, CalculatorConfig
from miles.rollouts.multi_turn import MultiTurn, MultiTurnConfig
from miles.rollouts.single_turn import SingleTurn, SingleTurnConfig


@hookimpl
def miles_register_rollout_functions() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.ROLLOUT_FUNCTION,
            "single_turn",
            SingleTurn,
            "one prompt, n independent responses (the default)",
            SingleTurnConfig,
        ),
        ComponentSpec(
            Kind.ROLLOUT_FUNCTION,
            "multi_turn",
            MultiTurn,
            "model turns and environment observations; observations are never trained on",
            MultiTurnConfig,
        ),
    ]


@hookimpl
def miles_register_environments() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.ENVIRONMENT,
            "calculator",
            Calculator,
            "arithmetic tool: <calc>expr</calc> returns the value, <answer>x</answer> ends",
            CalculatorConfig,
        ),
    ]
