"""Calling a reward the way a run does, with a time limit and readable errors.

A call that breaks the contract raises `Problem`; `score_all` collects them, and `summarize` turns
the same failure on several inputs into one line.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import numbers
import time
from collections.abc import Sequence
from typing import Any

from miles.plugin_kit.conformance.cases import Case


def describe_exc(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class Problem(Exception):
    """A call that breaks the contract: what went wrong, for which input, and any advice."""

    def __init__(
        self, wrong: str, what: str = "", advice: str = "", *, timed_out: bool = False
    ) -> None:
        super().__init__(wrong, what, advice)
        self.wrong, self.what, self.advice, self.timed_out = wrong, what, advice, timed_out

    def __str__(self) -> str:
        return f"{self.wrong} for {self.what}{self.advice}" if self.what else self.wrong


def describe_case(case: Case) -> str:
    """The input, for messages: the label, and the text when short enough to read."""
    if not case.response or len(case.response) > 40:
        return case.label
    return f"{case.label} {case.response!r}"


def finite_scores(n: int) -> str:
    return f"{n} finite score{'s' if n != 1 else ''}"


def within(bounds: tuple[float, float] | None) -> str:
    return f" in {list(bounds)}" if bounds else ""


async def await_result(value: Any, what: str, timeout: float) -> Any:
    """Await what a reward returned, which must be awaitable, for at most `timeout` seconds."""
    if not inspect.isawaitable(value):
        advice = ": rewards are awaited, so define `async def __call__`"
        raise Problem(f"returned {type(value).__name__} instead of an awaitable", what, advice)
    try:
        return await asyncio.wait_for(value, timeout)
    except TimeoutError:
        raise Problem(f"took longer than {timeout:g} s", what, timed_out=True) from None


def as_score(value: Any, what: str, bounds: tuple[float, float] | None) -> float:
    """`value` as a score: a finite real number, within `bounds` when given."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise Problem(f"returned {type(value).__name__} ({value!r:.60})", what, ", not a float")
    score = float(value)
    if not math.isfinite(score):
        raise Problem(f"returned {score}", what)
    if bounds is not None and not bounds[0] <= score <= bounds[1]:
        raise Problem(f"returned {score}, outside its reward_range {bounds},", what)
    return score


async def score(
    reward: Any, case: Case, bounds: tuple[float, float] | None, timeout: float
) -> float:
    """One call of the reward on `case`; raises `Problem` when it breaks the contract."""
    what = describe_case(case)
    # A fresh copy of the sample per call: a reward that mutates its sample must not skew others.
    sample = copy.deepcopy(case.sample)
    start = time.perf_counter()
    try:
        value = await await_result(reward(case.response, sample), what, timeout)
    except Problem:
        raise
    except Exception as exc:
        raise Problem(f"raised {describe_exc(exc)}", what) from exc
    # A reward that blocks the event loop cannot be interrupted; it is still caught afterwards.
    elapsed = time.perf_counter() - start
    if elapsed > timeout:
        raise Problem(f"took {elapsed:.1f} s (limit {timeout:g} s)", what, timed_out=True)
    return as_score(value, what, bounds)


async def score_all(
    reward: Any, cases: Sequence[Case], bounds: tuple[float, float] | None, timeout: float
) -> tuple[list[float], list[str]]:
    """Scores every case; returns the scores and the problems, one line per kind of problem."""
    scores: list[float] = []
    problems: list[Problem] = []
    for case in cases:
        try:
            scores.append(await score(reward, case, bounds, timeout))
        except Problem as exc:
            problems.append(exc)
            if exc.timed_out:  # one time-out is enough: do not wait for every input
                break
    return scores, summarize(problems)


def summarize(problems: list[Problem], show: int = 2) -> list[str]:
    """The same failure on several inputs is one line naming the first few inputs."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for p in problems:
        grouped.setdefault((p.wrong, p.advice), []).append(p.what)
    lines = []
    for (wrong, advice), whats in grouped.items():
        inputs = ", ".join(whats[:show])
        if len(whats) > show:
            inputs += f" and {len(whats) - show} more input{'s' if len(whats) > show + 1 else ''}"
        lines.append(str(Problem(wrong, inputs, advice)))
    return lines
