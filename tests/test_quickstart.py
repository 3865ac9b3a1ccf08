"""`miles run quickstart`, the README's first command: RL must visibly learn.

The control run stops after the SFT warm-start (steps=0): its held-out reward shows what the
policy can do without RL, and the same assertions must fail for it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conftest import read_jsonl, run_miles

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


def _run(run_dir: Path, *overrides: str) -> list[dict[str, Any]]:
    args = [a for o in ("telemetry.progress=false", *overrides) for a in ("--set", o)]
    proc = run_miles("run", "quickstart", "--run-dir", str(run_dir), *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_jsonl(run_dir / "metrics.jsonl")


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


@pytest.fixture(scope="module")
def control(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("qs") / "control", "steps=0")


def test_untrained_policy_does_not_pass(control: list[dict[str, Any]]) -> None:
    assert control[-1]["eval/reward_mean"] <= 0.4
    assert not learned(control)


# The quickstart as the README runs it. test_chaos.py reads the same run as its unharmed one.
QUICKSTART = ("quickstart", "--set", "telemetry.progress=false")


def test_quickstart_learns(shared_runs: Callable[..., Path], control: list[dict[str, Any]]) -> None:
    rows = read_jsonl(shared_runs("quickstart", *QUICKSTART) / "metrics.jsonl")
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert steps[0]["rollout/reward_mean"] <= 0.4
    assert rows[-1]["eval/reward_mean"] >= 0.8
    assert learned(rows)
    assert rows[-1]["eval/reward_mean"] - control[-1]["eval/reward_mean"] >= 0.4
