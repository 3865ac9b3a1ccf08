"""miles-sinks in a real run: TensorBoard, W&B (offline) and MLflow next to metrics.jsonl, a sink
that breaks mid-run, and a missing sink package caught before launch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from miles.core.runner import RunRequest, run_from_cli

from .conftest import read_jsonl, write_config

KEY = "rollout/reward_mean"


@pytest.fixture(scope="module")
def sinks_run(traced_run: tuple[Path, Any]) -> Path:
    """tests/conftest.py's observed run: 2 steps with every sink, the last MLflow one broken."""
    return traced_run[0]


def jsonl_values(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r[KEY]) for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_every_step_reaches_metrics_jsonl(sinks_run: Path) -> None:
    assert [step for step, _ in jsonl_values(sinks_run)] == [0, 1]


def test_tensorboard_got_both_steps(sinks_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(sinks_run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars(KEY)]
    want = jsonl_values(sinks_run)
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # float32


def test_wandb_got_both_steps(sinks_run: Path) -> None:
    (log_file,) = (sinks_run / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "run" and run["tags"] == ["e2e"]
    assert run["config"]["update"]["steps"] == 2  # the run's config.yaml
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h[KEY]) for h in history] == jsonl_values(sinks_run)


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # inside mlflow
def test_mlflow_got_both_steps(sinks_run: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{sinks_run / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("miles")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, KEY)]
    assert got == jsonl_values(sinks_run)


def test_broken_sink_is_switched_off_and_the_run_goes_on(sinks_run: Path) -> None:
    events = read_jsonl(sinks_run / "events.jsonl")
    failed = [e for e in events if e.get("event") == "metric sink failed; switching it off"]
    assert len(failed) == 1  # at step 0, once: then it is off
    assert failed[0]["sink"] == "telemetry.sinks[4] (mlflow)"  # the broken one, by position
    assert "cannot open an MLflow run" in failed[0]["error"] and "blocker" in failed[0]["error"]


def test_missing_sink_package_fails_the_config_check_before_launch(
    tmp_path: Path,
    tiny_assets: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "wandb" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)  # wandb is "not installed"
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # run_from_cli sets it; keep it to this test
    sinks = ["jsonl", {"name": "wandb", "mode": "offline"}]
    cfg = write_config(tmp_path / "cfg.yaml", tiny_assets, telemetry={"sinks": sinks})
    run_dir = tmp_path / "run"

    code = run_from_cli(RunRequest(target=str(cfg), overrides=[], run_dir=run_dir))

    err = capsys.readouterr().err
    assert code == 2, err
    assert "telemetry.sinks[1]" in err and "pip install 'miles-sinks[wandb]'" in err
    assert not run_dir.exists()  # refused before the run dir, the controller or Ray
