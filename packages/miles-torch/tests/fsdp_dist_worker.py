"""One rank of a multi-process FSDP2 run, for test_fsdp_dist.py (a script, not a test module).

    python fsdp_dist_worker.py DEVICE MODEL BATCH_NPZ OUT_DIR RANK WORLD_SIZE PORT [RESUME_DIR]

DEVICE is cpu (gloo) or cuda (nccl, rank r on GPU r).
Without RESUME_DIR: logprobs, two PPO steps, save OUT_DIR/ckpt, a third step. With it: load the
checkpoint and take the third step only. Writes OUT_DIR/metrics_rank<r>.json and, on rank 0,
OUT_DIR/result.safetensors (final weights and the logprobs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import PackedBatch
from miles.torch.testing import make_trainer

# Adam's large eps keeps the update smooth in the grad (see test_fsdp.py's micro-batching test).
CONFIG = dict(lr=1e-2, eps=1e-3, micro_batch_tokens=12, lr_schedule="linear", total_steps=4)


def ppo_clip(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    return loss, {"clipfrac": (ratio != clipped).float()}


def main() -> None:
    device, model, batch_file, out_dir, rank, world, port, *resume = sys.argv[1:]
    rank, world, out = int(rank), int(world), Path(out_dir)
    torch.set_num_threads(1)
    with np.load(batch_file, allow_pickle=False) as arrays:
        batch = PackedBatch(**{k: arrays[k] for k in arrays.files})
    trainer = make_trainer(
        model,
        master_port=int(port),
        rank=rank,
        world_size=world,
        device="cpu" if device == "cpu" else f"cuda:{rank}",
        **CONFIG,
    )
    metrics = []
    logprobs = trainer.logprobs(batch).logprobs
    if resume:
        trainer.load(resume[0])
    else:
        metrics.append(trainer.train_step(batch, ppo_clip))
        metrics.append(trainer.train_step(batch, ppo_clip))
        trainer.save(str(out / "ckpt"))
    metrics.append(trainer.train_step(batch, ppo_clip))
    result = {name: t.cpu().contiguous() for name, t in trainer.named_weights()}
    result["__logprobs__"] = torch.from_numpy(logprobs)
    (out / f"metrics_rank{rank}.json").write_text(json.dumps(metrics))
    if rank == 0:
        save_file(result, out / "result.safetensors")
    trainer.close()


if __name__ == "__main__":
    main()
