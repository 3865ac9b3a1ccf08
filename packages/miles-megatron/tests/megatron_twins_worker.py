"""Every model family with a Megatron mapping, its quickstart twin through the `megatron` backend
on one gloo CPU rank, with the native engine, without Ray (a script for test_megatron_twins.py:
one process start-up of torch, megatron-core and transformers for every family).

    python megatron_twins_worker.py OUT_DIR FAMILY [FAMILY ...]

Per family, as a run's step does (with a KL reference kept): the engine samples quickstart prompts (recording MoE routes),
the trainer's logprobs of those tokens are compared with the engine's, a policy-gradient step
trains, the weights sync into the engine in place (checksums compared), and the next rollout is
compared again. On an MoE twin the record is also replayed shifted to other experts, which must
move the logprobs (replay takes hold). Prints one JSON line per family.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import GenerateRequest, PackedBatch, Sample, SamplingParams
from miles.megatron.testing import make_trainer
from miles.recipes import quickstart_task
from miles.runtime.cluster.process import free_port
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.testing import sync_in_place

ADVANTAGES = [1.0, -1.0, 0.5, -0.5]


def _policy_gradient(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -inputs.advantages * inputs.logprobs, {}


def _rollout(engine: TorchRolloutEngine, seed: int) -> PackedBatch:
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


def _family(name: str, root: Path) -> dict[str, Any]:
    from miles.core.registry.families import family_named

    model_dir = root / name
    quickstart_task.build_model(model_dir, 0, family=name)
    moe = family_named(name).router is not None
    replay = "ids" if moe else "off"
    engine = TorchRolloutEngine(str(model_dir), dtype="float32", record_routing=replay)
    trainer = make_trainer(
        str(model_dir), master_port=free_port(), routing_replay=replay, lr=3e-3, reference=True
    )
    out: dict[str, Any] = {"family": name, "moe": moe, "diffs": []}
    try:
        for step in range(2):
            batch = _rollout(engine, seed=step)
            result = trainer.logprobs(batch)
            mask = batch.loss_mask > 0
            out["diffs"].append(float(np.abs(result.logprobs - batch.rollout_logprobs)[mask].max()))
            out[f"routing_{step}"] = result.metrics
            if step == 1:
                if moe and batch.routing is not None:  # other experts: other logprobs
                    experts = int(batch.routing.max()) + 1
                    shifted = batch.routing.copy()
                    shifted[shifted >= 0] = (shifted[shifted >= 0] + 1) % experts
                    batch.routing = shifted
                    moved = trainer.logprobs(batch).logprobs
                    out["shifted_diff"] = float(np.abs(moved - result.logprobs)[mask].max())
                break
            before = {n: t.clone() for n, t in trainer.named_weights()}
            assert result.ref_logprobs is not None
            out["ref_equal_at_start"] = float(np.abs(result.ref_logprobs - result.logprobs).max())
            metrics = trainer.train_step(batch, _policy_gradient)
            # The KL reference stays the initial policy while the policy moves.
            again = trainer.logprobs(batch)
            assert again.ref_logprobs is not None
            out["ref_kept"] = float(np.abs(again.ref_logprobs - result.ref_logprobs).max())
            out["policy_moved"] = float(np.abs(again.logprobs - result.logprobs)[mask].max())
            out["grad_norm"] = metrics["train/grad_norm"]
            after = {n: t.clone() for n, t in trainer.named_weights()}
            out["moved"] = any(not torch.equal(before[n], after[n]) for n in before)
            sync_in_place(trainer, engine)
            out["checksum_equal"] = engine.weights_checksum() == trainer.weights_checksum("float32")
            # A checkpoint round trip (buffers such as a router's expert bias included).
            trainer.save(str(root / f"{name}-ckpt"))
            trainer.train_step(batch, _policy_gradient)
            trainer.load(str(root / f"{name}-ckpt"))
            restored = dict(trainer.named_weights())
            out["checkpoint_restored"] = all(torch.equal(after[n], restored[n]) for n in after)
    finally:
        trainer.close()
    return out


def main() -> None:
    root, *families = sys.argv[1:]
    torch.set_num_threads(1)
    for name in families:
        print(json.dumps(_family(name, Path(root))), flush=True)


if __name__ == "__main__":
    main()
