"""The checks that hold a built reward to what it declares: its range, `score_group`, pickling
the way Ray ships it to actors, and determinism.

Each returns its status and a detail line (and what a later check needs, if anything).
"""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from miles.plugin_kit.conformance.cases import Case
from miles.plugin_kit.conformance.results import Status
from miles.plugin_kit.conformance.scoring import (
    Problem,
    as_score,
    await_result,
    describe_case,
    describe_exc,
    finite_scores,
    score,
    summarize,
    within,
)


def declared_range(reward: Any) -> tuple[float, float] | None:
    """The validated ``reward_range``, None when undeclared; raises Problem when malformed."""
    declared = getattr(reward, "reward_range", None)
    if declared is None:
        return None
    try:
        low, high = (float(x) for x in declared)
    except (TypeError, ValueError):
        raise Problem(
            f"reward_range must be a (low, high) pair of floats, got {declared!r}"
        ) from None
    if math.isnan(low) or math.isnan(high) or low > high:
        raise Problem(f"reward_range {declared!r} is not a range (low <= high)")
    return low, high


def check_declarations(reward: Any) -> tuple[Status, str, tuple[float, float] | None]:
    try:
        bounds = declared_range(reward)
    except Problem as exc:
        return "FAIL", str(exc), None
    deterministic = getattr(reward, "deterministic", None)
    if deterministic is not None and not isinstance(deterministic, bool):
        return "FAIL", f"deterministic must be a bool, got {deterministic!r}", bounds
    range_text = f"reward_range={bounds}" if bounds else "no reward_range (finiteness only)"
    det_text = "deterministic" if deterministic else "not declared deterministic"
    return "PASS", f"{range_text}; {det_text}", bounds


async def check_score_group(
    reward: Any,
    cases: Sequence[Case],
    bounds: tuple[float, float] | None,
    timeout: float,
    declared: bool | None,
) -> tuple[Status, str]:
    """`declared`: whether the spec declares `scores_groups` (None: no spec to say)."""
    score_group = getattr(reward, "score_group", None)
    if score_group is None:
        if declared:
            return "FAIL", "the spec declares scores_groups, but there is no score_group method"
        return "SKIP", "no score_group method"
    if declared is False:
        return "FAIL", (
            "it has score_group, but its spec does not declare Capability.SCORES_GROUPS: runs "
            "would never call it (add capabilities=frozenset({Capability.SCORES_GROUPS}))"
        )
    responses = [c.response for c in cases]
    samples = [copy.deepcopy(c.sample) for c in cases]
    what = f"a group of {len(cases)} responses"
    try:
        values = await await_result(score_group(responses, samples), what, timeout)
    except Problem as exc:
        return "FAIL", f"score_group {exc}"
    except Exception as exc:
        return "FAIL", f"score_group raised {describe_exc(exc)} for {what}"
    if not isinstance(values, Sequence) or len(values) != len(cases):
        got = f"{len(values)} scores" if isinstance(values, Sequence) else type(values).__name__
        return "FAIL", f"score_group returned {got} for {what}; expected {len(cases)} scores"
    problems = []
    for case, value in zip(cases, values, strict=True):
        try:
            as_score(value, case.label, bounds)
        except Problem as exc:
            problems.append(exc)
    if problems:
        return "FAIL", "; ".join(f"score_group {line} in a group" for line in summarize(problems))
    return "PASS", f"{finite_scores(len(cases))}{within(bounds)}"


def ray_dumps() -> tuple[str, Callable[[Any], bytes]]:
    """What Ray ships objects to actors with: cloudpickle (standalone or Ray's vendored copy)."""
    import importlib

    for module in ("cloudpickle", "ray.cloudpickle"):
        try:
            dumps: Callable[[Any], bytes] = importlib.import_module(module).dumps
            return module, dumps
        except ImportError:
            continue
    return "pickle", pickle.dumps


async def check_picklable(
    reward: Any, case: Case, bounds: tuple[float, float] | None, timeout: float
) -> tuple[Status, str, Any]:
    """Ray's pickler must round-trip the reward, and the copy must still score.

    Plain pickle failing alone (a class defined in ``__main__`` or a function body) is reported but
    does not fail: Ray pickles such classes by value.
    """
    name, dumps = ray_dumps()
    try:
        copied = pickle.loads(dumps(reward))
    except Exception as exc:
        hint = "a lock, client or open file? create it lazily, or drop it in __getstate__"
        return "FAIL", f"{name} cannot pickle it: {describe_exc(exc)} ({hint})", None
    try:
        await score(copied, case, bounds, timeout)
    except Problem as exc:
        return "FAIL", f"the copy {name} made {exc}", None
    detail = f"{name} round-trips it and the copy scores"
    if name != "pickle":
        try:
            pickle.dumps(reward)
        except Exception as exc:
            detail += f" (note: plain pickle fails: {describe_exc(exc)})"
    return "PASS", detail, copied


async def check_deterministic(
    reward: Any,
    unpickled: Any,
    cases: Sequence[Case],
    bounds: tuple[float, float] | None,
    timeout: float,
    repeats: int,
) -> tuple[Status, str]:
    if getattr(reward, "deterministic", False) is not True:
        return "SKIP", "not declared deterministic"
    instances = [reward] * repeats + ([unpickled] if unpickled is not None else [])
    for case in cases:
        seen: list[float] = []
        for instance in instances:
            try:
                seen.append(await score(instance, case, bounds, timeout))
            except Problem as exc:
                return "FAIL", str(exc)
        if len(set(seen)) > 1:
            return "FAIL", (
                f"declares deterministic but scored {describe_case(case)} "
                f"differently across {len(seen)} calls: {seen}"
            )
    return "PASS", f"{len(cases)} inputs x {len(instances)} calls gave identical scores"
