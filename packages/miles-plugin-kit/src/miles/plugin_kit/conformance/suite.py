"""Every check on one reward, in order: `check_reward`, and `acheck_reward` inside an event loop.

The reward is resolved (a spec, a registered name, or an already-built reward), built with its
config, then scored on ordinary, empty and garbage responses before the checks of `checks` hold
it to its declarations.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

from miles.core.contracts.components import Capability, Component, ComponentSpec, Kind
from miles.plugin_kit.conformance.cases import Case, garbage_cases, sample_cases, with_row
from miles.plugin_kit.conformance.checks import (
    check_declarations,
    check_deterministic,
    check_picklable,
    check_score_group,
)
from miles.plugin_kit.conformance.results import CHECKS, CheckResult, Status
from miles.plugin_kit.conformance.scoring import describe_exc, finite_scores, score_all, within

DEFAULT_TIMEOUT_S = 10.0

RewardTarget: TypeAlias = ComponentSpec | Component | str | Callable[..., Any]


def _resolve(target: RewardTarget) -> tuple[str, ComponentSpec | None, Any]:
    """(display name, spec or None, an already-built reward or None)."""
    if isinstance(target, str):
        from miles.core.registry.plugins import get_plugin_manager

        target = get_plugin_manager().get(Kind.REWARD, target)
    if isinstance(target, Component):
        target = target.spec
    if isinstance(target, ComponentSpec):
        if target.kind != Kind.REWARD:
            raise TypeError(f"{target.kind}/{target.name} is not a reward")
        return f"reward/{target.name}", target, None
    if not callable(target):
        raise TypeError(f"cannot check {target!r}: not a ComponentSpec, a name or a reward")
    name = getattr(target, "__name__", type(target).__name__)
    return f"reward/{name}", None, target


def _build(spec: ComponentSpec, config: Any) -> tuple[Any, str]:
    if spec.config is None:
        return spec.factory(), "built with no config"
    if config is None:
        # Every field must have a default: `reward: {name: x}` alone is a valid run config.
        config = spec.config()
    return spec.factory(config), f"built with {config!r}"


def _with_example(
    declared: Any, spec: ComponentSpec | None, config: Any, cases: Sequence[Case] | None
) -> tuple[Any, Sequence[Case] | None]:
    """The config and cases to check with, filled in from the class's `conformance_example`.

    A reward class may declare what a realistic check needs: `conformance_example = {"row":
    {...data-row fields...}, "config": {...options...}}`.
    """
    example = getattr(declared, "conformance_example", None) or {}
    if config is None and example.get("config") and spec is not None and spec.config is not None:
        config = spec.config(**example["config"])
    if cases is None and example.get("row"):
        cases = [
            Case(c.label, c.response, with_row(c.sample, example["row"])) for c in sample_cases()
        ]
    return config, cases


async def acheck_reward(
    target: RewardTarget,
    *,
    cases: Sequence[Case] | None = None,
    config: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    repeats: int = 3,
) -> list[CheckResult]:
    """:func:`check_reward` for callers already inside an event loop."""
    if cases is not None and not cases:
        raise ValueError("cases must hold at least one Case (or be None for the built-in ones)")
    name, spec, reward = _resolve(target)
    declared = spec.factory if spec is not None else type(reward)
    # `conformance_skip = "why"`: the reward cannot be checked offline (it calls a service).
    skip = getattr(declared, "conformance_skip", None)
    if skip:
        return [CheckResult(name, c, "SKIP", str(skip)) for c in CHECKS]
    config, cases = _with_example(declared, spec, config, cases)
    if reward is None:
        assert spec is not None
        try:
            reward, how = _build(spec, config)
        except Exception as exc:
            how = "with its default config " if config is None else ""
            hint = " (every config field needs a default)" if config is None else ""
            detail = f"building it {how}raised {describe_exc(exc)}{hint}"
            return [
                CheckResult(name, "builds", "FAIL", detail),
                *(CheckResult(name, c, "SKIP", "not built") for c in CHECKS[1:]),
            ]
        built = CheckResult(name, "builds", "PASS", how)
    else:
        built = CheckResult(name, "builds", "SKIP", "given an already-built reward")
    return [built, *await _check_built(name, spec, reward, cases, timeout, repeats)]


async def _check_built(
    name: str,
    spec: ComponentSpec | None,
    reward: Any,
    cases: Sequence[Case] | None,
    timeout: float,
    repeats: int,
) -> list[CheckResult]:
    """The checks after "builds", on the built `reward`."""
    results: list[CheckResult] = []

    def add(check: str, status: Status, detail: str) -> None:
        results.append(CheckResult(name, check, status, detail))

    def add_scores(check: str, scores: list[float], problems: list[str]) -> None:
        if problems:
            add(check, "FAIL", "; ".join(problems))
        else:
            add(check, "PASS", f"{finite_scores(len(scores))}{within(bounds)}")

    status, detail, bounds = check_declarations(reward)
    add("declarations", status, detail)
    # A malformed range still lets the other checks run, holding scores to finiteness only.
    ordinary = list(cases) if cases is not None else sample_cases()
    add_scores("sample inputs", *await score_all(reward, ordinary, bounds, timeout))
    # Empty and garbage responses answer the first ordinary input's data row.
    empty = [Case("an empty response", "", ordinary[0].sample)]
    add_scores("empty response", *await score_all(reward, empty, bounds, timeout))
    garbage = garbage_cases(ordinary[0].sample)
    add_scores("garbage responses", *await score_all(reward, garbage, bounds, timeout))
    group = [*ordinary[:3], *empty, *garbage[:2]]
    groups = spec.has(Capability.SCORES_GROUPS) if spec is not None else None
    add("score_group", *await check_score_group(reward, group, bounds, timeout, groups))
    status, detail, unpickled = await check_picklable(reward, ordinary[0], bounds, timeout)
    add("picklable", status, detail)
    probes = [*ordinary, *empty, garbage[1]]
    add(
        "deterministic",
        *await check_deterministic(reward, unpickled, probes, bounds, timeout, repeats),
    )
    return results


def check_reward(
    target: RewardTarget,
    *,
    cases: Sequence[Case] | None = None,
    config: Any = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    repeats: int = 3,
) -> list[CheckResult]:
    """Runs every conformance check on one reward and returns one result per check.

    ``target`` is a reward ``ComponentSpec`` (built with its config's defaults), a registered
    ``Component``, a registered reward name or ``package.module:attr`` path, or an already-built
    reward. ``config`` replaces the default-built config of a spec. ``cases`` replace the built-in
    ordinary inputs (e.g. samples carrying the data-row fields your reward reads); empty and
    garbage responses, answering the first case's sample, are always tried. Each call may take at
    most ``timeout`` seconds; a deterministic reward is called ``repeats`` times per input.
    """
    return asyncio.run(
        acheck_reward(target, cases=cases, config=config, timeout=timeout, repeats=repeats)
    )
