"""Every installed model family's tiny twin through RL on CPU: rollout, train, weight sync and
(for MoE families) routing replay, with the real torch engine and FSDP trainer.

A family's twin is its real architecture class with tiny dimensions and random weights, built
as `miles run quickstart --set model.family=F` builds it. For every family, an in-process test
runs the engine (`TorchRolloutEngine`) and the trainer (`FSDPTrainer`) the run's actors hold,
without Ray: the engine samples, the trainer's logprobs of the sampled tokens agree with the
engine's, a policy-gradient step moves the weights, the sync gives the engine the trainer's
weights (equal checksums), and the next rollout agrees again; on an MoE family the engine
records every token's experts and the trainer routes through them.

One family (DeepSeek-V4: custom modeling code and MoE) also runs the whole thing end to end, as
a user types it: `miles run` with its actors, reward and metrics. Only one, because each
`miles run` costs ~30 CPU-seconds of process start-up (Ray and four actors) on the 2-core CI
machine, while the in-process test checks the same agreement with the same engine and trainer
classes in a few seconds.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from miles.core.contracts.components import Kind
from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import GenerateRequest, PackedBatch, Sample, SamplingParams
from miles.core.registry.plugins import get_plugin_manager
from miles.recipes import quickstart_task
from miles.runtime.cluster.process import free_port
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.testing import make_trainer, sync_in_place

from .conftest import read_jsonl, run_miles

torch.set_num_threads(1)


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
# The family that also runs end to end: custom modeling code and MoE, else the first MoE family.
E2E_FAMILY = (
    "deepseek_v4"
    if "deepseek_v4" in FAMILIES
    else next((f for f in FAMILIES if f in MOE), FAMILIES[0])
)


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


@pytest.mark.timeout(1200)  # an end-to-end run (the suite's default limit is for unit tests)
def test_twin_runs_rl_end_to_end(tmp_path: Path) -> None:
    family = E2E_FAMILY
    run_dir = tmp_path / family
    proc = _run(family, run_dir)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
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


# ── in process: the same engine and trainer, no Ray ─────────────────────────────────────────────

ADVANTAGES = [1.0, -1.0, 0.5, -0.5]  # nonzero: every sample has a gradient


def _policy_gradient(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE: -A * logp per token."""
    return -inputs.advantages * inputs.logprobs, {}


def _rollout(engine: TorchRolloutEngine, seed: int) -> PackedBatch:
    """Quickstart prompts sampled at temperature 1 (as the run does), packed with the engine's
    logprobs and, on an MoE twin, its routing records."""
    rng = np.random.default_rng(seed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    requests = [
        GenerateRequest(
            i,
            engine.tokenizer.encode(
                quickstart_task.make_prompt(rng.choice(10, size=n, replace=False).tolist())
            ),
            sampling,
        )
        for i, n in enumerate([2, 3, 4, 5])
    ]
    results = sorted(engine.results(requests), key=lambda r: r.request_id)
    samples = [
        Sample(
            prompt_ids=req.prompt_ids,
            response_ids=res.response_ids,
            rollout_logprobs=res.logprobs,
            sample_id=req.request_id,
            weight_version=res.weight_version,
            routing=res.routing,
            routing_weights=res.routing_weights,
        )
        for req, res in zip(requests, results, strict=True)
    ]
    return PackedBatch.from_samples(samples, advantages=ADVANTAGES)


def _weights(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.named_weights()}


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_engine_and_trainer_agree_in_process(family: str, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    quickstart_task.build_model(model_dir, 0, family=family)
    replay = "ids" if family in MOE else "off"
    # fp32 on CPU, as the run on CPU: the two sides agree to 1e-4.
    engine = TorchRolloutEngine(str(model_dir), dtype="float32", record_routing=replay)
    trainer = make_trainer(str(model_dir), master_port=free_port(), routing_replay=replay, lr=3e-3)
    try:
        for step in range(2):
            batch = _rollout(engine, seed=step)
            result = trainer.logprobs(batch)
            mask = batch.loss_mask > 0
            assert mask.any()
            # Step 1's rollout ran on the weights step 0 trained and synced.
            diff = float(np.abs(result.logprobs - batch.rollout_logprobs)[mask].max())
            assert diff < 1e-4, (family, step, diff)
            if family in MOE:
                # The engine recorded every token's experts; the trainer's experts received them.
                assert batch.routing is not None and (batch.routing >= 0).any()
                assert result.metrics["moe/replayed_tokens"] > 0, result.metrics
                assert result.metrics["moe/replayed_match"] == 1.0, result.metrics
            else:
                assert batch.routing is None
            if step == 1:
                break
            before = _weights(trainer)
            metrics = trainer.train_step(batch, _policy_gradient)
            assert metrics["train/grad_norm"] > 0, metrics
            after = _weights(trainer)
            assert any(not torch.equal(before[n], after[n]) for n in before)
            sync_in_place(trainer, engine)
            assert engine.weight_version == 1
            assert engine.weights_checksum() == trainer.weights_checksum("float32")
    finally:
        trainer.close()
