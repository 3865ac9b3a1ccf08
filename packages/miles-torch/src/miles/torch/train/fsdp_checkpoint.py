"""Saving and loading an `FSDPTrainer`: its trained models' full weights and optimizer state,
the step counts and each rank's RNG.

The directory layout and the file helpers are `checkpoint`'s (shared with the megatron
backend); this module gathers the sharded state into those files and shards it back. Saving and
loading are collective: every rank takes part in each all-gather, rank 0 alone writes the model
files, and every rank writes and reads its own RNG file.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles.torch.train import checkpoint as ckpt
from miles.torch.train.build import load_hf_model
from miles.torch.train.host_adamw import HostAdamW
from miles.torch.train.values import load_critic
from miles.torch.weights import named_state

CHECKPOINT_FORMAT = 1
ADAPTER_FILE = "adapter.safetensors"  # with LoRA, the checkpoint's only model weights


@dataclasses.dataclass(frozen=True)
class Trained:
    """One model the trainer trains, as its checkpoint holds it."""

    model: Any  # the sharded Hugging Face model (an FSDPModule)
    optimizer: torch.optim.Optimizer
    layer_prefixes: list[str]  # its decoder layers' name prefixes (see `layer_groups`)
    subdir: Path  # its files' directory inside the checkpoint
    adapters_only: bool = False  # LoRA: only the adapters are saved; the base is model_path's
    critic: bool = False  # the value model: a token-classification checkpoint


def save_checkpoint(
    path: str,
    trained: list[Trained],
    state: dict[str, Any],
    *,
    rank: int,
    device: torch.device,
    model_path: str,
    generation_config: Any,
) -> None:
    """Write the checkpoint directory `path` atomically. `state`: trainer_state.json's fields
    (the format is added here); `model_path`'s tokenizer files are copied along."""
    with ckpt.atomic_directory(path, rank) as tmp:
        for t in trained:
            if t.adapters_only:
                weights = _gather_adapters(t.model, rank)  # the base is model_path, unchanged
            else:
                weights = _gather_weights(t.model, t.layer_prefixes, rank)
            optim = ckpt.gather_optimizer(t.model, t.optimizer, rank)
            if rank == 0:
                out = tmp / t.subdir
                out.mkdir(exist_ok=True)
                weights_file = ADAPTER_FILE if t.adapters_only else ckpt.MODEL_FILE
                save_file(weights, out / weights_file, metadata={"format": "pt"})
                save_file(optim, out / ckpt.OPTIMIZER_FILE)
                t.model.config.save_pretrained(out)
        rng = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        save_file(rng, tmp / ckpt.rng_file(rank))
        if rank == 0:
            if generation_config is not None:
                generation_config.save_pretrained(tmp)
            ckpt.copy_tokenizer_files(model_path, tmp)
            ckpt.write_json(tmp / ckpt.STATE_FILE, {"format": CHECKPOINT_FORMAT, **state})


def read_state(path: str, has_critic: bool) -> dict[str, Any]:
    """trainer_state.json, checked against this code's format and the trainer's critic."""
    state: dict[str, Any] = json.loads((Path(path) / ckpt.STATE_FILE).read_text())
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {state['format']}, expected 1")
    if has_critic and "critic_step" not in state:
        raise ValueError(f"{path}: checkpoint has no critic, but this trainer trains one")
    return state


@torch.no_grad()
def load_trained(root: Path, trained: list[Trained], attn: str) -> None:
    """Copy each model's weights and optimizer state from the checkpoint at `root` into this
    rank's shards. `attn`: the attention implementation the models were built with."""
    for t in trained:
        if t.adapters_only:
            adapters = load_file(root / t.subdir / ADAPTER_FILE)
            for name, tensor in named_state(t.model):
                if ".lora_" in name:
                    tensor.copy_(ckpt.shard_like(adapters[name], tensor))
            ckpt.load_optimizer(t.model, t.optimizer, root / t.subdir / ckpt.OPTIMIZER_FILE)
            continue
        # from_pretrained undoes the on-disk weight format (e.g. fuses MoE experts) for us.
        source = (load_critic if t.critic else load_hf_model)(str(root / t.subdir), attn)
        full = dict(source.state_dict())
        for name, tensor in named_state(t.model):
            tensor.copy_(ckpt.shard_like(full[name], tensor))
        del source, full
        ckpt.load_optimizer(t.model, t.optimizer, root / t.subdir / ckpt.OPTIMIZER_FILE)
    for t in trained:
        if isinstance(t.optimizer, HostAdamW):
            t.optimizer.to_host()  # loaded onto the device, they rest on the host


def load_rng(root: Path, rank: int, device: torch.device) -> None:
    """Restore this rank's RNG states, if the checkpoint has its file."""
    rng_path = root / ckpt.rng_file(rank)
    if rng_path.is_file():
        states = load_file(rng_path)
        torch.set_rng_state(states["cpu"])
        if device.type == "cuda" and "cuda" in states:
            torch.cuda.set_rng_state(states["cuda"], device)


def layer_groups(
    model: torch.nn.Module, prefixes: list[str]
) -> list[list[tuple[str, torch.Tensor]]]:
    """`model`'s parameters and buffers grouped by decoder layer (the rest in one group).

    A weight-format conversion (fused MoE experts back to per-expert tensors) never spans
    layers, so a group is a unit of conversion as well as of memory.
    """
    groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named_state(model):
        key = next((p for p in prefixes if name.startswith(p)), "")
        groups.setdefault(key, []).append((name, tensor))
    return list(groups.values())


def _gather_adapters(model: torch.nn.Module, rank: int) -> dict[str, torch.Tensor]:
    """The LoRA adapters' full tensors on rank 0 (empty elsewhere). Collective."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in named_state(model):
        if ".lora_" in name:
            full = ckpt.full_tensor(tensor)
            if rank == 0:
                out[name] = full.detach().cpu().contiguous()
    return out


def _gather_weights(model: Any, prefixes: list[str], rank: int) -> dict[str, torch.Tensor]:
    """`model`'s full weights under their on-disk names, as save_pretrained writes them; on
    rank 0 only (empty elsewhere). Collective."""
    from transformers.core_model_loading import revert_weight_conversion

    weights: dict[str, torch.Tensor] = {}
    for group in layer_groups(model, prefixes):
        full = {name: ckpt.full_tensor(t) for name, t in group}
        if rank == 0:
            for name, t in revert_weight_conversion(model, full).items():
                weights[name] = t.detach().cpu().contiguous()
    return weights
