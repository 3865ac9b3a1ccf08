"""Run checkpoints: the train group's state, the rollout side's, and the engines' RNGs, written
atomically as one `checkpoints/step_N` (safetensors and JSON)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray import ObjectRef

from miles.core.config import CheckpointConfig
from miles.core.observability.telemetry import carrier, span
from miles.runtime.actors.train_group import TrainGroup
from miles.runtime.rundir import atomic_checkpoint, prune_checkpoints

if TYPE_CHECKING:
    from miles.runtime.actors.engine_group import EngineGroupHandle
    from miles.runtime.rollout.rollout_manager import RolloutHandle


def save(
    run_dir: Path,
    step: int,
    version: int,
    trainers: TrainGroup,
    rollout: RolloutHandle,
    engines: EngineGroupHandle,
    cfg: CheckpointConfig,
    rollout_result: Callable[[ObjectRef[dict[str, object]]], dict[str, object]] = ray.get,
) -> Path:
    """Writes checkpoint `step` (the number of steps done; the engines hold weight `version`);
    returns its path.
    `rollout_result` waits for the rollout side's state, which waits for the batches in flight
    (the controller's brings restarted engines in meanwhile)."""
    with span("miles.checkpoint", step=step), atomic_checkpoint(run_dir, step) as tmp:
        trainers.save(str(tmp / "train"), carrier())
        # The rollout side first: it finishes the batches in flight, then the engines' RNGs
        # are where those batches left them.
        rollout_state = rollout_result(rollout.get_state.remote())
        state = {
            "step": step,
            "numbering": "steps_done",  # step_k is after k steps (before, step_k was after k + 1)
            "weight_version": version,
            "rollout": rollout_state,
            "engines": {"rng": ray.get(engines.rng_states.remote())},
        }
        (tmp / "state.json").write_text(json.dumps(state) + "\n")
    prune_checkpoints(run_dir, cfg.keep_last, cfg.keep_every)
    return step_dir(run_dir, step)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}"


def restore(
    path: Path, trainers: TrainGroup, rollout: RolloutHandle, engines: EngineGroupHandle
) -> dict[str, Any]:
    """Loads a checkpoint into the train group, the rollout side and the engines' RNGs;
    returns its state.json."""
    state: dict[str, Any] = json.loads((path / "state.json").read_text())
    trainers.load(str(path / "train"))
    ray.get(
        [
            rollout.set_state.remote(state["rollout"]),
            engines.set_rng_states.remote(state.get("engines", {}).get("rng", [])),
        ]
    )
    return state
