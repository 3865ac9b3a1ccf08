"""Every installed model family's tiny twin through a short RL run on CPU: rollout, reward, train,
weight sync and (for MoE families) routing replay, with the same `miles run` a user types.

`miles run quickstart --set model.family=F` builds F's twin (its real architecture class, tiny
dimensions, random weights) and runs the quickstart task on it. Two steps show that the engine
and trainer agree on every token's logprob before and after a weight sync, that gradients flow,
and that MoE replay routes each token through the experts the engine used.
"""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from miles.core.components import Kind
from miles.core.plugins import get_plugin_manager

from .conftest import read_jsonl, run_miles

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(1200)


def _families() -> list[str]:
    manager = get_plugin_manager()
    return [
        name
        for name in manager.registry.names(Kind.FAMILY)
        if manager.get(Kind.FAMILY, name).spec.factory().tiny is not None
    ]


# Qwen3 and Qwen3-MoE run the same way in test_quickstart.py and test_moe_replay.py.
FAMILIES = [f for f in _families() if f not in ("qwen3", "qwen3_moe")]
MOE = {n for n in FAMILIES if get_plugin_manager().get(Kind.FAMILY, n).spec.factory().router}


def test_every_named_model_has_a_family_with_a_twin() -> None:
    for name in ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "deepseek_v4", "kimi_k25"):
        assert name in _families()
    assert "glm_moe_dsa" in _families()


def _run(family: str, run_dir: Path) -> subprocess.CompletedProcess[str]:
    replay = "ids" if family in MOE else "off"
    return run_miles(
        "run",
        "quickstart",
        "--run-dir",
        str(run_dir),
        "--set",
        f"model.family={family}",
        "--set",
        f"moe.routing_replay={replay}",
        *("--set", "steps=2", "--set", "warmstart.steps=0", "--set", "eval.data=null"),
        *("--set", "rollout.prompts_per_step=4", "--set", "rollout.samples_per_prompt=4"),
        *("--set", "reward={name: 'miles_test_rewards:char_count'}"),
        *("--set", "telemetry.progress=false", "--set", "checkpoint.at_end=false"),
    )


@pytest.fixture(scope="module")
def twin_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Every family's run, two at a time: a run mostly waits on process start-up, so two share
    the 2-core CI machine well (each has its own local Ray)."""
    root = tmp_path_factory.mktemp("twins")
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = {f: pool.submit(_run, f, root / f) for f in FAMILIES}
        return {f: (root / f, p.result()) for f, p in procs.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_runs_rl_end_to_end(family: str, twin_runs: dict[str, tuple[Path, Any]]) -> None:
    run_dir, proc = twin_runs[family]
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in steps] == [0, 1]
    for m in steps:
        assert m["rollout/samples"] == 16
        # The engine and the trainer compute the same logprobs for the same tokens: step 1's
        # rollout ran on the weights step 0 trained and synced.
        assert m["train/rollout_logprob_abs_diff"] < 1e-4, (family, m)
        assert m["train/grad_norm"] > 0
    assert steps[-1]["weights/version"] == 2
    if family in MOE:
        for m in steps:
            assert m["moe/replayed_tokens"] > 0
            assert m["moe/replayed_match"] == 1.0
