"""Chaos: the quickstart, with engines and trainers killed (`kill -9`) at seeded random moments
in every phase of the step, in sync and async mode. The run must finish, account for every
sample exactly once, and learn as well as an unharmed run of the same seed."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from .chaos import ChaosMonkey
from .conftest import MILES, TEST_MODULES, read_jsonl
from .test_quickstart import QUICKSTART

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(1800)

# How far the learning outcome (held-out reward over 256 prompts) may lie from the unharmed
# run's, and the least the unharmed run must reach for the comparison to mean anything (an
# untrained policy scores about 0.12). Both modes compare with the unharmed sync run, the
# quickstart itself.
# - sync: a run is reproducible step for step, so only the faults move it; restarted engines
#   draw other samples than the lost ones would have, and where the kills land follows the
#   machine's load: 0.1 (a fresh-clone run beside other work ended 0.87 against 0.96).
# - async: which samples are one version stale depends on timing, so two unharmed async runs of
#   one seed already differ from each other and from sync: 0.96 and 0.81 on the loaded CI
#   machine (0.96 and 0.97 on an idle one; sync 0.96). An unharmed async run of its own would
#   be a reference no closer than that, at the price of a whole run.
MARGIN = {"sync": 0.1, "async": 0.2}
BASELINE = 0.8
# Each run: two engine and three trainer deaths, one in each phase (plus one more in training).
PHASES = ["rollout", "train", "sync", "checkpoint", "reward", "train"]
SETTINGS = [
    "telemetry.progress=false",
    "checkpoint.every=5",
    "fault.backoff_s=0.1",
    "fault.max_engine_restarts=8",
    "fault.max_train_restarts=8",
]
SEED = 7  # the monkey's
MODES = {"sync": [], "async": ["mode=async", "async.max_staleness=1", "algorithm.correction=tis"]}


def _quickstart(run_dir: Path, mode: str, harmed: bool) -> Path:
    """Runs the quickstart; with `harmed`, a chaos monkey kills processes while it runs, and
    what it killed goes to RUN_DIR.kills.json."""
    args = [a for s in [*SETTINGS, *MODES[mode]] for a in ("--set", s)]
    env = {**os.environ, "CI": "1", "PYTHONPATH": str(TEST_MODULES)}
    with open(run_dir.with_suffix(".stderr"), "w") as stderr:
        proc = subprocess.Popen(
            [*MILES, "run", "quickstart", "--run-dir", str(run_dir), *args],
            env=env,
            stdout=stderr,  # the run's summary is on stdout, its log on stderr: one file
            stderr=stderr,
            start_new_session=True,  # the monkey kills only this run's processes
        )
        monkey = None
        if harmed:
            monkey = ChaosMonkey(
                proc.pid, PHASES, seed=SEED, pause_s=(2.0, 5.0), patience_s=240
            ).start()
        try:
            returncode = proc.wait(timeout=900)
        finally:
            if monkey is not None:
                monkey.stop()
    assert returncode == 0, run_dir.with_suffix(".stderr").read_text()[-4000:]
    if monkey is not None:
        kills = {"kills": [dataclasses.asdict(k) for k in monkey.kills], "skipped": monkey.skipped}
        run_dir.with_suffix(".kills.json").write_text(json.dumps(kills))
    return run_dir


def _final_eval(run_dir: Path) -> float:
    return float(read_jsonl(run_dir / "metrics.jsonl")[-1]["eval/reward_mean"])


def _assert_every_sample_once(run_dir: Path) -> None:
    ledger = read_jsonl(run_dir / "samples.jsonl")
    ids = [row["sample_id"] for row in ledger]
    assert len(ids) == len(set(ids)), "a sample id was recorded twice"
    assert sorted(ids) == list(range(len(ids))), "a sample id is missing"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    trained = sum(row["fate"] == "trained" for row in ledger)
    rollout = config["rollout"]
    assert trained <= config["steps"] * rollout["prompts_per_step"] * rollout["samples_per_prompt"]


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, shared_runs: Callable[..., Path]
) -> dict[tuple[str, bool], Path]:
    """(mode, harmed) -> run dir: the runs two at a time (four at once took longer on the 2-core
    CI machine: 300 s against 223-290 s). Each harmed run has its own Ray, and each monkey kills
    only its own run's processes. The unharmed run is the quickstart test_quickstart.py reads
    (the chaos settings change no number: checkpoints and restart budgets)."""
    root = tmp_path_factory.mktemp("chaos")
    keys = [*((mode, True) for mode in MODES), ("sync", False)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {
            k: pool.submit(shared_runs, "quickstart", *QUICKSTART)
            if k == ("sync", False)
            else pool.submit(_quickstart, root / f"{k[0]}-{k[1]}", *k)
            for k in keys
        }
        return {k: job.result() for k, job in jobs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_runs_survive_kills_in_every_phase_and_learn_as_unharmed(
    runs: dict[tuple[str, bool], Path], mode: str
) -> None:
    run_dir = runs[mode, True]
    kills = json.loads(run_dir.with_suffix(".kills.json").read_text())
    print(
        f"{mode}: kills {[(k['phase'], k['victim']) for k in kills['kills']]}, "
        f"skipped {kills['skipped']}"
    )
    victims = [k["victim"] for k in kills["kills"]]
    engines = sum(v.startswith("ray::EngineActor") for v in victims)
    trainers = sum(v.startswith("ray::TrainActor") for v in victims)
    assert engines >= 1 and trainers >= 2 and len(victims) >= 4, kills
    steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "fault/train_restarts" in r]
    final: dict[str, Any] = steps[-1]
    assert final["fault/train_restarts"] >= trainers
    assert final["fault/engine_restarts"] >= engines
    assert "faults survived:" in run_dir.with_suffix(".stderr").read_text()
    _assert_every_sample_once(run_dir)
    unharmed, harmed = _final_eval(runs["sync", False]), _final_eval(run_dir)
    assert unharmed >= BASELINE, unharmed  # else the comparison says nothing
    assert abs(harmed - unharmed) <= MARGIN[mode], (harmed, unharmed)
