"""One rank of a multi-process FSDP2 critic run, for test_fsdp_critic.py (a script, not a test).

    python fsdp_critic_worker.py MODEL BATCH_NPZ OUT_DIR RANK WORLD_SIZE PORT [RESUME_DIR]

CPU (gloo) only. Without RESUME_DIR: values, two value steps, save OUT_DIR/ckpt, a third step.
With it: load the checkpoint and take the third step only. Writes OUT_DIR/metrics_rank<r>.json
and, on rank 0, OUT_DIR/result.safetensors (the critic's final weights and the first values).
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
from miles.torch.train import checkpoint as ckpt
from miles.torch.weights import named_state

CONFIG = dict(
    lr=1e-6,
    critic=True,
    critic_lr=1e-2,
    eps=1e-3,
    micro_batch_tokens=12,
    lr_schedule="linear",
    total_steps=4,
)


def clipped_mse(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss, so that old_values matter too."""
    assert inputs.values is not None and inputs.old_values is not None
    assert inputs.returns is not None
    err = (inputs.values - inputs.returns).square()
    moved = torch.clamp(inputs.values - inputs.old_values, -0.05, 0.05)
    err_clipped = (inputs.old_values + moved - inputs.returns).square()
    return 0.5 * torch.maximum(err, err_clipped), {"train/value_error": err.detach()}


def main() -> None:
    model, batch_file, out_dir, rank, world, port, *resume = sys.argv[1:]
    rank, world, out = int(rank), int(world), Path(out_dir)
    torch.set_num_threads(1)
    with np.load(batch_file, allow_pickle=False) as arrays:
        batch = PackedBatch(**{k: arrays[k] for k in arrays.files})
    trainer = make_trainer(
        model,
        master_port=int(port),
        rank=rank,
        world_size=world,
        **CONFIG,
    )
    metrics = []
    values = trainer.values(batch)
    if resume:
        trainer.load(resume[0])
    else:
        metrics.append(trainer.train_value_step(batch, clipped_mse))
        metrics.append(trainer.train_value_step(batch, clipped_mse))
        trainer.save(str(out / "ckpt"))
    metrics.append(trainer.train_value_step(batch, clipped_mse))
    result = {
        name: ckpt.full_tensor(t).cpu().contiguous() for name, t in named_state(trainer.critic)
    }
    result["__values__"] = torch.from_numpy(values)
    (out / f"metrics_rank{rank}.json").write_text(json.dumps(metrics))
    if rank == 0:
        save_file(result, out / "result.safetensors")
    trainer.close()


if __name__ == "__main__":
    main()
