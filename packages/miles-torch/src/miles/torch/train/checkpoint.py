"""Checkpoint files: safetensors and JSON only (no pickle), written atomically.

A checkpoint directory holds
  model.safetensors + config.json (+ tokenizer files)  a Hugging Face checkpoint of the policy
  optimizer.safetensors                                full AdamW state, "<param>/<key>" per tensor
  rng_rank<r>.safetensors                              each rank's torch RNG states
  trainer_state.json                                   step (and critic_step), world size, config
  critic/                                              with a critic: its model.safetensors,
                                                       config.json (token classification, one
                                                       label) and optimizer.safetensors
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "trainer_state.json"
# The tokenizer's files, copied along so that the checkpoint can be served as it is.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.safetensors"


@contextlib.contextmanager
def atomic_directory(path: str | Path, rank: int) -> Iterator[Path]:
    """All ranks write into `<path>.tmp`; rank 0 renames it to `path` once every rank is done.

    A crash mid-save leaves any previous checkpoint at `path` intact. Needs a filesystem that
    all ranks share.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    yield tmp
    _barrier()
    if rank == 0:
        old = path.with_name(path.name + ".old")
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def copy_tokenizer_files(src: str | Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) parameter or state; collective for DTensor.

    On a mesh of one rank the local shard is the whole tensor: it is returned as it is, without
    the all-gather (a collective launch and a copy per tensor, which dominated a one-GPU weight
    sync)."""
    if not isinstance(t, DTensor):
        return t.detach()
    if t.device_mesh.size() == 1:
        local = t.to_local()
        if local.shape == t.shape:
            return local.detach()
    return t.full_tensor()


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out like `like` (a DTensor shard or a plain tensor), on its device and dtype.

    Every rank holds `full`, so each just slices its own shard: no communication.
    """
    full = full.to(device=like.device, dtype=like.dtype)
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)
    return full


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> dict[str, torch.Tensor]:
    """Full optimizer state as "<param>/<key>" tensors, on rank 0 (empty elsewhere). Collective."""
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            if key != "step" and isinstance(value, torch.Tensor):
                value = value.to(param.device)  # moments that rest on the host (HostAdamW)
            gathered = full_tensor(value)
            if rank == 0:
                out[f"{name}/{key}"] = gathered.cpu().contiguous()
    return out


def load_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, file: Path) -> None:
    """Replace `optimizer`'s state by that in `file` (as `gather_optimizer` wrote it)."""
    optimizer.state.clear()
    with safe_open(str(file), framework="pt") as f:
        keys = set(f.keys())
        for name, param in model.named_parameters():
            entries = {k.split("/", 1)[1] for k in keys if k.startswith(name + "/")}
            st: dict[str, torch.Tensor] = {}
            for key in entries:
                value = f.get_tensor(f"{name}/{key}")
                # "step" is a CPU scalar in AdamW; moments are shaped and sharded like the param.
                st[key] = value if key == "step" else shard_like(value, param)
            if st:
                optimizer.state[param] = st
