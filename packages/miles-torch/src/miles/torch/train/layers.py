"""The units FSDP shards by (the decoder layers); compiling one, and activation checkpointing of one."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules Hugging Face marks as unsplittable (the decoder layers): one FSDP unit each."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules to shard by")
    return layers


def recompute_in_backward(layer: torch.nn.Module) -> None:
    """Recompute `layer` in backward. It stays inside the layer's FSDP unit: the recompute runs
    while FSDP has the layer's weights gathered for its backward."""
    inner = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward


def compile_layer(layer: torch.nn.Module, *, fallback: bool) -> None:
    """Run `layer`'s own forward through `torch.compile` with dynamic shapes (packed micro-batches
    vary in length). Only the forward is swapped, so parameter names, FSDP's hooks around the
    call and checkpoints stay as they are. `fallback`: what Dynamo cannot trace runs eagerly."""
    if fallback:
        torch._dynamo.config.suppress_errors = True
    layer.forward = torch.compile(layer.forward, dynamic=True)
