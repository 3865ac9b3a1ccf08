"""A backend from outside the project plugs in without a core edit: a third-party distribution
(module + dist-info entry point, as pip leaves one) registers a train backend and a rollout
backend with capabilities and memory models of their own. The planner adds up their memory
models, the config checks hold the run to their capabilities, and `miles run` drives them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from .conftest import install_plugin, run_miles

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

PLUGIN = """
import os

from miles.core import Capability, ComponentSpec, Kind, hookimpl
from miles.core.contracts.memory import engine, sharded_data_parallel
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.train.config import FSDPConfig


def _log(line):
    with open(os.environ["MILES_TEST_BACKEND_LOG"], "a") as f:
        f.write(line + "\\n")


def make_trainer(config, setup):
    from miles.torch.train.fsdp import FSDPTrainer

    class Trainer(FSDPTrainer):
        def train_step(self, batch, loss):
            _log(f"train_step rank={self.rank}")
            return super().train_step(batch, loss)

    _log(f"trainer rank={setup.rank} reference={setup.reference}")
    return Trainer(config, setup)


def make_engine(config, setup):
    from miles.torch.plugin import make_engine as torch_engine

    _log(f"engine dtype={setup.precision.rollout_dtype}")
    return torch_engine(config, setup)


def train_memory(inputs, config):
    plain = sharded_data_parallel(
        inputs, micro_batch_tokens=config.micro_batch_tokens, activation_checkpointing=False,
        reference_copy=False,
    )
    # A backend that keeps a second full fp32 copy of the weights on every rank.
    params = inputs.shape.params.language_model
    return plain.__class__(
        weights=4 * params, gradients=plain.gradients, optimizer=plain.optimizer,
        activations=plain.activations, micro_batch_tokens=config.micro_batch_tokens,
        notes=("sized by miles-test-backend",),
    )


def rollout_memory(inputs, config):
    return engine(inputs, max_batch_size=config.max_batch_size, prefill_chunk_tokens=7)


@hookimpl
def miles_register_train_backends():
    return [ComponentSpec(
        Kind.TRAIN_BACKEND, "replicated", make_trainer, "FSDP, logging its steps", FSDPConfig,
        capabilities=frozenset({Capability.LORA}), memory=train_memory,
    )]


@hookimpl
def miles_register_rollout_backends():
    return [ComponentSpec(
        Kind.ROLLOUT_BACKEND, "chunked", make_engine, "the torch engine, logging", TorchEngineConfig,
        capabilities=frozenset({Capability.PARTIAL_ROLLOUT}), memory=rollout_memory,
    )]
"""


def _env(tmp_path: Path) -> dict[str, str]:
    return {"MILES_TEST_BACKEND_LOG": str(tmp_path / "backend.log")}


def test_the_planner_adds_up_the_plugins_memory_models(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    install_plugin("backend", PLUGIN)
    config = {
        "model": {"path": tiny_assets["model"]},
        "data": {"path": tiny_assets["data"]},
        "train": {"backend": "replicated", "world_size": 2, "micro_batch_tokens": 64},
        "rollout": {"backend": "chunked", "max_batch_size": 4},
        "planner": {"prompt_tokens": 100},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = run_miles("recipes", "plan", str(path), "--json", env=_env(tmp_path))
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    params = plan["params"]["language_model"]
    assert plan["train_gb"]["weights"] * 1e9 == pytest.approx(4 * params)  # its own, unsharded
    assert plan["train_gb"]["optimizer"] * 1e9 == pytest.approx(8 * params / 2)  # sharded
    assert "sized by miles-test-backend" in plan["notes"]
    # The rollout model prefills in chunks of 7 tokens: 4 sequences x 100 tokens would be 400.
    table = run_miles("recipes", "plan", str(path), env=_env(tmp_path)).stdout
    assert "prefill 7 tokens" in table and "KV cache (4 seqs" in table


def test_miles_run_drives_the_plugins_backends(tmp_path: Path) -> None:
    install_plugin("backend", PLUGIN)
    run_dir = tmp_path / "run"
    proc = run_miles(
        "run", "quickstart", "--run-dir", str(run_dir),
        "--set", "steps=2", "--set", "warmstart.steps=2", "--set", "eval.max_prompts=8",
        "--set", "train.backend=replicated", "--set", "rollout.backend=chunked",
        env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "backend.log").read_text().splitlines()
    assert log.count("trainer rank=0 reference=False") == 1
    assert log.count("engine dtype=float32") == 1
    assert log.count("train_step rank=0") == 2 + 2  # warm-start and RL steps
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["weights/version"] for m in metrics if "weights/version" in m] == [2.0, 3.0]


def test_the_run_is_held_to_the_plugins_capabilities(tmp_path: Path) -> None:
    install_plugin("backend", PLUGIN)
    proc = run_miles(
        "run", "quickstart", "--run-dir", str(tmp_path / "run"),
        "--set", "train.backend=replicated", "--set", "rollout.backend=chunked",
        "--set", "algorithm.kl.coef=0.1", "--set", "placement=colocated",
        env=_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2
    err = proc.stderr
    assert (
        "algorithm.kl.coef: a KL term needs reference logprobs, but train_backend 'replicated' "
        "cannot (reference is not among its capabilities: lora)" in err
    )
    assert "train.backend: placement: colocated" in err and "rollout.backend: placement" in err
    assert not os.path.exists(tmp_path / "backend.log")  # refused before any worker started
