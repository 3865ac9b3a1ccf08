"""Conformance checks for reward components: what `miles plugins check` runs.

A reward is built with its config dataclass and scores with ``async def __call__(self, response:
str, sample: Sample) -> float``. It may declare, as class attributes,

* ``reward_range: tuple[float, float]``: every score must lie in it (undeclared: scores need only
  be finite);
* ``deterministic: bool``: when true, the same inputs must give the same scores on every call;

and it may provide ``async def score_group(responses, samples) -> list[float]``.

The checks run the reward on ordinary inputs, on empty and garbage responses (a policy early in
training produces those), pickle it the way Ray ships objects to actors, and hold it to what it
declares. Each yields a :class:`CheckResult` whose ``detail`` says what is wrong when it fails.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import math
import numbers
import pickle
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from miles.core.components import Capability, Component, ComponentSpec, Kind
from miles.core.types import Sample

Status = Literal["PASS", "FAIL", "SKIP"]

# The checks, in the order they run and are reported.
CHECKS = (
    "builds",
    "declarations",
    "sample inputs",
    "empty response",
    "garbage responses",
    "score_group",
    "picklable",
    "deterministic",
)

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CheckResult:
    """One check of one component. ``detail`` says what was checked, or what is wrong."""

    component: str  # "reward/NAME"
    check: str  # one of CHECKS
    status: Status
    detail: str = ""

    @property
    def passed(self) -> bool:
        """True unless the check failed (a skipped check does not fail)."""
        return self.status != "FAIL"

    @property
    def message(self) -> str:
        """One line naming the component, e.g. "reward 'bad': returned nan for an empty response"."""
        kind, _, name = self.component.partition("/")
        return (
            f"{kind} {name!r}: {self.detail}" if self.detail else f"{kind} {name!r}: {self.check}"
        )


@dataclass(frozen=True)
class Case:
    """One input to score: a response and the sample (data row) it answers."""

    label: str
    response: str
    sample: Sample = field(compare=False)


def default_sample() -> Sample:
    """A plausible finished sample: a math prompt whose data row carries the usual answer keys."""
    return Sample(
        prompt_ids=[101, 102, 103, 104],
        response_ids=[201, 202, 203],
        rollout_logprobs=[-0.5, -1.0, -0.25],
        metadata={
            "prompt": "What is 6 * 7? Answer with a number.",
            "answer": "42",
            "label": "42",
            "ground_truth": "42",
            "solution": "6 * 7 = 42",
        },
    )


def _with_row(sample: Sample, row: dict[str, Any]) -> Sample:
    return dataclasses.replace(sample, metadata={**sample.metadata, **row})


def sample_cases() -> list[Case]:
    """Ordinary responses: right, wrong, verbose and off-topic."""
    responses = {
        "a correct answer": "42",
        "a correct sentence": "The answer is 42.",
        "a reasoning trace": "Let's think step by step. 6 * 7 = 42. So the answer is \\boxed{42}.",
        "a wrong answer": "The answer is 41.",
        "an off-topic response": "I like trains.",
    }
    return [Case(label, text, default_sample()) for label, text in responses.items()]


def garbage_cases(sample: Sample | None = None, seed: int = 0) -> list[Case]:
    """Responses a half-trained policy produces: noise, control bytes, and very long text."""
    rng = random.Random(seed)
    # Any code point but the surrogates, which no tokenizer's decode returns.
    unicode_noise = "".join(
        chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)]))
        for _ in range(20_000)
    )
    binary_ish = "".join(chr(rng.randrange(0, 256)) for _ in range(5_000))
    responses = {
        "whitespace only": " \n\t \r\n ",
        "long random unicode": unicode_noise,
        "binary-ish text": binary_ish,
        "a huge response (2 MB)": "the answer is 42 " * 120_000,
        "unbalanced markup": "\\boxed{ {{{ <think> ``` $$ \\frac{",
    }
    row = sample if sample is not None else default_sample()
    return [Case(label, text, row) for label, text in responses.items()]


# ── resolving what to check ──────────────────────────────────────────────────────────────────────


RewardTarget = ComponentSpec | Component | str | Callable[..., Any]


def _resolve(target: RewardTarget) -> tuple[str, ComponentSpec | None, Any]:
    """(display name, spec or None, an already-built reward or None)."""
    if isinstance(target, str):
        from miles.core.plugins import get_plugin_manager

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


# ── scoring, with time limits and readable errors ────────────────────────────────────────────────


def _describe_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class _Problem(Exception):
    """A call that breaks the contract: what went wrong, for which input, and any advice."""

    def __init__(
        self, wrong: str, what: str = "", advice: str = "", *, timed_out: bool = False
    ) -> None:
        super().__init__(wrong, what, advice)
        self.wrong, self.what, self.advice, self.timed_out = wrong, what, advice, timed_out

    def __str__(self) -> str:
        return f"{self.wrong} for {self.what}{self.advice}" if self.what else self.wrong


def _what(case: Case) -> str:
    """The input, for messages: the label, and the text when short enough to read."""
    if not case.response or len(case.response) > 40:
        return case.label
    return f"{case.label} {case.response!r}"


async def _await(value: Any, what: str, timeout: float) -> Any:
    if not inspect.isawaitable(value):
        advice = ": rewards are awaited, so define `async def __call__`"
        raise _Problem(f"returned {type(value).__name__} instead of an awaitable", what, advice)
    try:
        return await asyncio.wait_for(value, timeout)
    except TimeoutError:
        raise _Problem(f"took longer than {timeout:g} s", what, timed_out=True) from None


def _as_score(value: Any, what: str, bounds: tuple[float, float] | None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _Problem(f"returned {type(value).__name__} ({value!r:.60})", what, ", not a float")
    score = float(value)
    if not math.isfinite(score):
        raise _Problem(f"returned {score}", what)
    if bounds is not None and not bounds[0] <= score <= bounds[1]:
        raise _Problem(f"returned {score}, outside its reward_range {bounds},", what)
    return score


async def _score(
    reward: Any, case: Case, bounds: tuple[float, float] | None, timeout: float
) -> float:
    what = _what(case)
    # A fresh copy of the sample per call: a reward that mutates its sample must not skew others.
    sample = copy.deepcopy(case.sample)
    start = time.perf_counter()
    try:
        value = await _await(reward(case.response, sample), what, timeout)
    except _Problem:
        raise
    except Exception as exc:
        raise _Problem(f"raised {_describe_exc(exc)}", what) from exc
    # A reward that blocks the event loop cannot be interrupted; it is still caught afterwards.
    elapsed = time.perf_counter() - start
    if elapsed > timeout:
        raise _Problem(f"took {elapsed:.1f} s (limit {timeout:g} s)", what, timed_out=True)
    return _as_score(value, what, bounds)


async def _score_all(
    reward: Any, cases: Sequence[Case], bounds: tuple[float, float] | None, timeout: float
) -> tuple[list[float], list[str]]:
    """Scores every case; returns the scores and the problems, one line per kind of problem."""
    scores: list[float] = []
    problems: list[_Problem] = []
    for case in cases:
        try:
            scores.append(await _score(reward, case, bounds, timeout))
        except _Problem as exc:
            problems.append(exc)
            if exc.timed_out:  # one time-out is enough: do not wait for every input
                break
    return scores, _summarize(problems)


def _summarize(problems: list[_Problem], show: int = 2) -> list[str]:
    """The same failure on several inputs is one line naming the first few inputs."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for p in problems:
        grouped.setdefault((p.wrong, p.advice), []).append(p.what)
    lines = []
    for (wrong, advice), whats in grouped.items():
        inputs = ", ".join(whats[:show])
        if len(whats) > show:
            inputs += f" and {len(whats) - show} more input{'s' if len(whats) > show + 1 else ''}"
        lines.append(str(_Problem(wrong, inputs, advice)))
    return lines


# ── the checks ───────────────────────────────────────────────────────────────────────────────────


def _declared_range(reward: Any) -> tuple[float, float] | None:
    """The validated ``reward_range``, None when undeclared; raises _Problem when malformed."""
    declared = getattr(reward, "reward_range", None)
    if declared is None:
        return None
    try:
        low, high = (float(x) for x in declared)
    except (TypeError, ValueError):
        raise _Problem(
            f"reward_range must be a (low, high) pair of floats, got {declared!r}"
        ) from None
    if math.isnan(low) or math.isnan(high) or low > high:
        raise _Problem(f"reward_range {declared!r} is not a range (low <= high)")
    return low, high


def _check_declarations(reward: Any) -> tuple[Status, str, tuple[float, float] | None]:
    try:
        bounds = _declared_range(reward)
    except _Problem as exc:
        return "FAIL", str(exc), None
    deterministic = getattr(reward, "deterministic", None)
    if deterministic is not None and not isinstance(deterministic, bool):
        return "FAIL", f"deterministic must be a bool, got {deterministic!r}", bounds
    range_text = f"reward_range={bounds}" if bounds else "no reward_range (finiteness only)"
    det_text = "deterministic" if deterministic else "not declared deterministic"
    return "PASS", f"{range_text}; {det_text}", bounds


async def _check_score_group(
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
        values = await _await(score_group(responses, samples), what, timeout)
    except _Problem as exc:
        return "FAIL", f"score_group {exc}"
    except Exception as exc:
        return "FAIL", f"score_group raised {_describe_exc(exc)} for {what}"
    if not isinstance(values, Sequence) or len(values) != len(cases):
        got = f"{len(values)} scores" if isinstance(values, Sequence) else type(values).__name__
        return "FAIL", f"score_group returned {got} for {what}; expected {len(cases)} scores"
    problems = []
    for case, value in zip(cases, values, strict=True):
        try:
            _as_score(value, case.label, bounds)
        except _Problem as exc:
            problems.append(exc)
    if problems:
        return "FAIL", "; ".join(f"score_group {line} in a group" for line in _summarize(problems))
    return "PASS", f"{_scores(len(cases))}{_in(bounds)}"


def _scores(n: int) -> str:
    return f"{n} finite score{'s' if n != 1 else ''}"


def _in(bounds: tuple[float, float] | None) -> str:
    return f" in {list(bounds)}" if bounds else ""


def _ray_dumps() -> tuple[str, Callable[[Any], bytes]]:
    """What Ray ships objects to actors with: cloudpickle (standalone or Ray's vendored copy)."""
    import importlib

    for module in ("cloudpickle", "ray.cloudpickle"):
        try:
            dumps: Callable[[Any], bytes] = importlib.import_module(module).dumps
            return module, dumps
        except ImportError:
            continue
    return "pickle", pickle.dumps


async def _check_picklable(
    reward: Any, case: Case, bounds: tuple[float, float] | None, timeout: float
) -> tuple[Status, str, Any]:
    """Ray's pickler must round-trip the reward, and the copy must still score.

    Plain pickle failing alone (a class defined in ``__main__`` or a function body) is reported but
    does not fail: Ray pickles such classes by value.
    """
    name, dumps = _ray_dumps()
    try:
        copied = pickle.loads(dumps(reward))
    except Exception as exc:
        hint = "a lock, client or open file? create it lazily, or drop it in __getstate__"
        return "FAIL", f"{name} cannot pickle it: {_describe_exc(exc)} ({hint})", None
    try:
        await _score(copied, case, bounds, timeout)
    except _Problem as exc:
        return "FAIL", f"the copy {name} made {exc}", None
    detail = f"{name} round-trips it and the copy scores"
    if name != "pickle":
        try:
            pickle.dumps(reward)
        except Exception as exc:
            detail += f" (note: plain pickle fails: {_describe_exc(exc)})"
    return "PASS", detail, copied


async def _check_deterministic(
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
                seen.append(await _score(instance, case, bounds, timeout))
            except _Problem as exc:
                return "FAIL", str(exc)
        if len(set(seen)) > 1:
            return "FAIL", (
                f"declares deterministic but scored {_what(case)} "
                f"differently across {len(seen)} calls: {seen}"
            )
    return "PASS", f"{len(cases)} inputs x {len(instances)} calls gave identical scores"


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
    results: list[CheckResult] = []
    # A reward class may declare what a realistic check needs: `conformance_example = {"row":
    # {...data-row fields...}, "config": {...options...}}`, or `conformance_skip = "why"` when it
    # cannot be checked offline (it calls a service).
    declared = spec.factory if spec is not None else type(reward)
    skip = getattr(declared, "conformance_skip", None)
    if skip:
        return [CheckResult(name, c, "SKIP", str(skip)) for c in CHECKS]
    example = getattr(declared, "conformance_example", None) or {}
    if config is None and example.get("config") and spec is not None and spec.config is not None:
        config = spec.config(**example["config"])
    if cases is None and example.get("row"):
        cases = [
            Case(c.label, c.response, _with_row(c.sample, example["row"])) for c in sample_cases()
        ]

    def add(check: str, status: Status, detail: str) -> None:
        results.append(CheckResult(name, check, status, detail))

    def add_scores(check: str, scores: list[float], problems: list[str]) -> None:
        if problems:
            add(check, "FAIL", "; ".join(problems))
        else:
            add(check, "PASS", f"{_scores(len(scores))}{_in(bounds)}")

    if reward is None:
        assert spec is not None
        try:
            reward, how = _build(spec, config)
        except Exception as exc:
            how = "with its default config " if config is None else ""
            hint = " (every config field needs a default)" if config is None else ""
            add("builds", "FAIL", f"building it {how}raised {_describe_exc(exc)}{hint}")
            results.extend(CheckResult(name, c, "SKIP", "not built") for c in CHECKS[1:])
            return results
        add("builds", "PASS", how)
    else:
        add("builds", "SKIP", "given an already-built reward")

    status, detail, bounds = _check_declarations(reward)
    add("declarations", status, detail)
    # A malformed range still lets the other checks run, holding scores to finiteness only.
    ordinary = list(cases) if cases is not None else sample_cases()
    add_scores("sample inputs", *await _score_all(reward, ordinary, bounds, timeout))
    # Empty and garbage responses answer the first ordinary input's data row.
    empty = [Case("an empty response", "", ordinary[0].sample)]
    add_scores("empty response", *await _score_all(reward, empty, bounds, timeout))
    garbage = garbage_cases(ordinary[0].sample)
    add_scores("garbage responses", *await _score_all(reward, garbage, bounds, timeout))
    group = [*ordinary[:3], *empty, *garbage[:2]]
    groups = spec.has(Capability.SCORES_GROUPS) if spec is not None else None
    add("score_group", *await _check_score_group(reward, group, bounds, timeout, groups))
    status, detail, unpickled = await _check_picklable(reward, ordinary[0], bounds, timeout)
    add("picklable", status, detail)
    probes = [*ordinary, *empty, garbage[1]]
    add(
        "deterministic",
        *await _check_deterministic(reward, unpickled, probes, bounds, timeout, repeats),
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


def format_results(results: Sequence[CheckResult]) -> str:
    """A plain-text table: COMPONENT, CHECK, RESULT, DETAIL."""
    rows = [("COMPONENT", "CHECK", "RESULT", "DETAIL")]
    rows += [(r.component, r.check, r.status, r.detail) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[3]]).rstrip()
        for row in rows
    )
