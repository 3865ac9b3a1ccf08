"""`miles run quickstart`, the README's first command: RL must visibly learn.

The control is the policy after the SFT warm-start, before any RL step: the run evaluates it
first (`eval.at_start`, which changes no number of the run after it). Its held-out reward shows
what the policy can do without RL, and the same assertions must fail for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conftest import read_jsonl

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


def learned(rows: list[dict[str, Any]]) -> bool:
    """The quickstart's promise: near chance at step 0, >= 0.8 on held-out prompts at the end,
    and training reward that rose by a clear margin on the way."""
    steps = [r for r in rows if "rollout/reward_mean" in r]
    final_eval = rows[-1]["eval/reward_mean"]
    if not steps:
        return bool(final_eval >= 0.8)
    start = steps[0]["rollout/reward_mean"]
    end = sum(r["rollout/reward_mean"] for r in steps[-5:]) / len(steps[-5:])
    return start <= 0.4 and final_eval >= 0.8 and end - start >= 0.3


# The quickstart as the README runs it, plus an evaluation before the first step (the control).
# test_chaos.py reads the same run as its unharmed one.
QUICKSTART = ("quickstart", "--set", "telemetry.progress=false", "--set", "eval.at_start=true")


@pytest.fixture(scope="module")
def quickstart(shared_runs: Callable[..., Path]) -> list[dict[str, Any]]:
    return read_jsonl(shared_runs("quickstart", *QUICKSTART) / "metrics.jsonl")


@pytest.fixture(scope="module")
def control(quickstart: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of a run that stopped after the warm-start: the evaluation before step 0."""
    first = quickstart[0]
    assert first["step"] == 0 and "eval/reward_mean" in first and "rollout/reward_mean" not in first
    return [first]


def test_untrained_policy_does_not_pass(control: list[dict[str, Any]]) -> None:
    assert control[-1]["eval/reward_mean"] <= 0.4
    assert not learned(control)


def test_quickstart_learns(quickstart: list[dict[str, Any]], control: list[dict[str, Any]]) -> None:
    rows = quickstart
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert steps[0]["rollout/reward_mean"] <= 0.4
    assert rows[-1]["eval/reward_mean"] >= 0.8
    assert learned(rows)
    assert rows[-1]["eval/reward_mean"] - control[-1]["eval/reward_mean"] >= 0.4
