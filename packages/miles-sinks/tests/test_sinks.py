"""Each sink logs three steps, closes, and its backend's own reader gives the values back."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from miles.core import Kind
from miles.core.config import ComponentRef
from miles.core.registry.factory import build_component
from miles.core.registry.plugins import PluginManager
from miles.sinks.common import scalars
from miles.sinks.config import MlflowConfig, TensorBoardConfig, WandbConfig

# Three steps as the controller sends them; the last three keys of each row must be skipped.
STEPS: list[dict[str, Any]] = [
    {
        "rollout/reward_mean": 0.25 * (step + 1),
        "train/loss": 1.5 - step,
        "rollout/tokens": 100 + step,  # an int
        "train/grad_norm": np.float64(0.5 + step),  # a numpy scalar
        "bad/nan": math.nan,
        "bad/text": "not a number",
        "bad/none": None,
    }
    for step in range(3)
]
LOGGED = ["rollout/reward_mean", "train/loss", "rollout/tokens", "train/grad_norm"]


def expected(key: str) -> list[tuple[int, float]]:
    return [(step, float(row[key])) for step, row in enumerate(STEPS)]


def log_steps(sink: Any) -> None:
    for step, row in enumerate(STEPS):
        sink.log(step, row)
    sink.close()


def sink(name: str, run_dir: Path, **options: Any) -> Any:
    """Built the way the controller builds it: by name, through the plugin manager."""
    return build_component(Kind.METRIC_SINK, ComponentRef(name, options), str(run_dir))


# ── TensorBoard ─────────────────────────────────────────────────────────────────────────────────


def test_tensorboard_reads_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(sink("tensorboard", tmp_path))
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == sorted(LOGGED)
    for key in LOGGED:
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert [s for s, _ in got] == [0, 1, 2]
        assert [v for _, v in got] == pytest.approx([v for _, v in expected(key)], rel=1e-6)


def test_tensorboard_log_dir_option(tmp_path: Path) -> None:
    log_steps(sink("tensorboard", tmp_path / "run", log_dir=str(tmp_path / "tb")))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


# ── Weights & Biases (offline) ──────────────────────────────────────────────────────────────────


def wandb_records(wandb_dir: Path) -> list[dict[str, Any]]:
    """The offline run's transaction log, read by wandb's own reader (`wandb leet inspect`)."""
    (log_file,) = wandb_dir.glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def test_wandb_offline_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: nothing may reach the network
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"steps": 3, "train": {"lr": 0.001}}))

    log_steps(sink("wandb", run_dir, mode="offline", tags=["test"]))

    records = wandb_records(run_dir / "wandb")
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "my-run" and run["project"] == "miles"
    assert run["tags"] == ["test"]
    assert run["config"]["update"]["train"] == {"lr": 0.001}
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"].get("num", 0) for h in history] == [0, 1, 2]  # proto3 leaves out a 0
    for key in LOGGED:
        assert [(h["item"]["_step"], h["item"][key]) for h in history] == expected(key)
    assert not any(k.startswith("bad/") for h in history for k in h["item"])


# ── MLflow ──────────────────────────────────────────────────────────────────────────────────────


def mlflow_history(tracking_uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert sorted(run.data.metrics) == sorted(LOGGED)
    return {
        key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in LOGGED
    }


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # inside mlflow
def test_mlflow_default_store_reads_back(tmp_path: Path) -> None:
    s = sink("mlflow", tmp_path)
    assert not (tmp_path / "mlflow.db").exists()  # the MLflow run opens at the first step
    log_steps(s)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert s.tracking_uri == uri
    history = mlflow_history(uri, s.run_id)
    assert history == {key: expected(key) for key in LOGGED}


def test_mlflow_file_store_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores otherwise
    uri = (tmp_path / "mlruns").as_uri()
    s = sink("mlflow", tmp_path, tracking_uri=uri, experiment="exp", run_name="r1")
    log_steps(s)
    history = mlflow_history(uri, s.run_id)
    assert history == {key: expected(key) for key in LOGGED}

    from mlflow import MlflowClient

    run = MlflowClient(uri).get_run(s.run_id)
    assert run.info.run_name == "r1"
    assert MlflowClient(uri).get_experiment(run.info.experiment_id).name == "exp"


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")
def test_mlflow_unusable_store_fails_at_log_time(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a regular file where the store's folder should be")
    s = sink("mlflow", tmp_path, tracking_uri=f"sqlite:///{blocker}/mlflow.db")
    with pytest.raises(RuntimeError, match=r"cannot open an MLflow run .*blocker.*FileExistsError"):
        s.log(0, STEPS[0])
    s.close()  # nothing was opened: nothing to end


# ── values, missing packages, registration ──────────────────────────────────────────────────────


def test_scalars_keeps_finite_numbers_only() -> None:
    row = {
        "a": 1,
        "b": 2.5,
        "c": np.float32(0.5),
        "d": True,
        "step": 7,
        "nan": math.nan,
        "inf": -math.inf,
        "none": None,
        "text": "x",
        "list": [1.0],
        "array": np.ones(2),
    }
    assert scalars(row) == {"a": 1, "b": 2.5, "c": 0.5, "d": 1}


@pytest.mark.parametrize(
    ("module", "config", "sink_class"),
    [
        ("tensorboard", TensorBoardConfig, "miles.sinks.tensorboard:TensorBoardSink"),
        ("wandb", WandbConfig, "miles.sinks.wandb:WandbSink"),
        ("mlflow", MlflowConfig, "miles.sinks.mlflow:MlflowSink"),
    ],
)
def test_missing_package_names_the_pip_command(
    module: str, config: type, sink_class: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    built = config()  # while the package is there
    module_name, _, attr = sink_class.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    monkeypatch.setitem(sys.modules, module, None)  # now `import <module>` fails, as if missing
    command = f"pip install 'miles-sinks[{module}]'"
    with pytest.raises(ValueError, match=re.escape(command)):
        config()
    with pytest.raises(ImportError, match=re.escape(command)):
        cls(built, str(tmp_path))


def test_plugin_manager_finds_the_sinks() -> None:
    manager = PluginManager().load()
    record = manager.records["miles-sinks"]
    assert record.status == "ok", record.error
    assert record.components == {"metric_sink": ["mlflow", "tensorboard", "wandb"]}
    for name in ("tensorboard", "wandb", "mlflow"):
        assert manager.registry.get(Kind.METRIC_SINK, name).distribution == "miles-sinks"


def test_listing_and_checking_import_no_backend() -> None:
    code = (
        "import sys\n"
        "from miles.core.registry.plugins import PluginManager\n"
        "from miles.sinks import plugin\n"
        "manager = PluginManager().load()\n"
        "for spec in plugin.miles_register_metric_sinks():\n"
        "    spec.config()  # the config check looks the package up without importing it\n"
        "print(sorted(m for m in ('tensorboard', 'wandb', 'mlflow') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
