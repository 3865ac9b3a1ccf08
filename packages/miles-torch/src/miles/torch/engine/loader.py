"""Loading a Hugging Face checkpoint for inference, and copying new weights into it by name."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch
from transformers import PreTrainedModel

from miles.torch.models import load_causal_lm, load_tokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def load_model(model_path: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) from a local directory or hub id; the model in eval mode, no grads."""
    model = load_causal_lm(model_path, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    tokenizer = load_tokenizer(model_path)
    return model, tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    """Token ids that end every sequence: the tokenizer's eos plus the generation config's."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    return frozenset(int(i) for i in ids if i is not None)


def cache_kwarg(model: PreTrainedModel) -> str:
    """The forward() argument that takes the KV cache: `cache` from transformers 5.2x on,
    `past_key_values` before (still accepted after, with a deprecation warning)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def copy_weights(model: PreTrainedModel, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy each (Hugging Face name, tensor) into the model; returns how many were copied.

    Strict about names and shapes (ValueError naming the tensor), lenient about dtype and device
    (the value is cast to the parameter's). A subset of the weights is fine: a trainer may stream
    them in buckets. Tensors are checked one at a time, so a bad one leaves earlier ones copied.
    """
    targets = model.state_dict(keep_vars=True)
    count = 0
    for name, tensor in named_tensors:
        if name not in targets:
            raise ValueError(f"load_weights: unknown tensor {name!r} for {type(model).__name__}")
        target = targets[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"load_weights: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(target.shape)}"
            )
        target.data.copy_(tensor.detach())
        count += 1
    return count
