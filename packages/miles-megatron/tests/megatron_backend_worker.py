"""One rank of a `megatron` (or, for the reference, `fsdp`) train backend on CPU ranks, for
test_megatron_backend.py (a script, not a test module).

    python megatron_backend_worker.py BACKEND LAYOUT MODEL BATCH_NPZ OUT_DIR RANK WORLD PORT
        [RESUME_DIR]

BACKEND is megatron or fsdp; LAYOUT tp2, pp2, ep2 or tp1 (the run's train.parallel). Without
RESUME_DIR: logprobs, two PPO steps, save OUT_DIR/ckpt, a third step, then a weight sync in place
into a native engine on rank 0 (its checksum against the trainer's). With it: load the checkpoint
and take the third step only. Writes OUT_DIR/metrics_rank<r>.json and, on rank 0,
OUT_DIR/result.safetensors (the final weights under Hugging Face names, and the logprobs).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import PackedBatch

# Adam's large eps keeps the update smooth in the gradient; a linear LR schedule is stepped.
CONFIG = dict(lr=1e-2, eps=1e-3, micro_batch_tokens=12, lr_schedule="linear", total_steps=4)


def ppo_clip(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    return loss, {"clipfrac": (ratio != clipped).float()}


def main() -> None:
    backend, layout, model, batch_file, out_dir, rank, world, port, *resume = sys.argv[1:]
    rank, world, out = int(rank), int(world), Path(out_dir)
    torch.set_num_threads(1)
    with np.load(batch_file, allow_pickle=False) as arrays:
        batch = PackedBatch(**{k: arrays[k] for k in arrays.files})
    if backend == "fsdp":
        from miles.torch.testing import make_trainer
    else:
        from miles.megatron.testing import make_trainer
    sizes = {"tp": "tensor", "pp": "pipeline", "ep": "expert"}
    parallel = {sizes[layout[:2]]: int(layout[2:])} if backend == "megatron" else {}
    # MILES_TEST_DEVICE=cuda: rank r on GPU r, bf16 compute (fp32 main weights) on both sides.
    options: dict[str, object] = {}
    if os.environ.get("MILES_TEST_DEVICE") == "cuda":
        from miles.precision.dtype import bf16

        options = {"device": f"cuda:{rank}", "dtype": "bfloat16", "precision": bf16()}
    trainer = make_trainer(
        model, master_port=int(port), rank=rank, world_size=world, **parallel, **options, **CONFIG
    )
    metrics = []
    result = trainer.logprobs(batch)
    if resume:
        trainer.load(resume[0])
    else:
        metrics.append(trainer.train_step(batch, ppo_clip))
        metrics.append(trainer.train_step(batch, ppo_clip))
        trainer.save(str(out / "ckpt"))
    metrics.append(trainer.train_step(batch, ppo_clip))
    weights = {name: t.detach().cpu().clone() for name, t in trainer.named_weights()}
    weights["__logprobs__"] = torch.from_numpy(result.logprobs)
    weights["__entropy__"] = torch.from_numpy(result.entropy)
    summary: dict[str, object] = {"metrics": metrics, "routing": result.metrics}
    # On CPU: a sync in place into an engine in this process. On a GPU the in-place handles are
    # CUDA IPC, which a process cannot open for itself: runs check that path (colocated quickstart).
    if not resume and os.environ.get("MILES_TEST_DEVICE") != "cuda":
        summary["sync_checksum_equal"] = _sync_to_engine(trainer, model, rank)
    (out / f"metrics_rank{rank}.json").write_text(json.dumps(summary))
    if rank == 0:
        save_file(weights, out / "result.safetensors")
    trainer.close()


def _sync_to_engine(trainer: object, model: str, rank: int) -> bool | None:
    """Colocated-style sync into a native engine on rank 0 (every rank gathers); whether the
    engine's checksum equals the trainer's."""
    plan = trainer.weight_sync_plan(1 << 20)  # type: ignore[attr-defined]
    if rank != 0:
        trainer.send_weights_in_place(plan, None)  # type: ignore[attr-defined]
        trainer.weights_checksum("float32")  # type: ignore[attr-defined]
        return None
    from miles.torch.engine.engine import TorchRolloutEngine

    engine = TorchRolloutEngine(model, device="cpu", dtype="float32", seed=0)
    trainer.send_weights_in_place(  # type: ignore[attr-defined]
        plan, lambda i, h: engine.load_bucket(plan, i, h)
    )
    engine.set_weight_version(1)
    return bool(engine.weights_checksum() == trainer.weights_checksum("float32"))  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
