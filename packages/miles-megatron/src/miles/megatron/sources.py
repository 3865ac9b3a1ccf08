"""Hugging Face checkpoints as weight sources: each rank reads only the slices it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from miles.core.contracts.family import MegatronMapping
from miles.megatron.convert import Index, TensorSource, WeightSource


class SafetensorsSource:
    """The safetensors files of a checkpoint directory (`model.safetensors`, or the shards named
    by `model.safetensors.index.json`), read lazily: a slice of a tensor reads that slice."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        index = root / "model.safetensors.index.json"
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._file = {name: root / file for name, file in weight_map.items()}
        elif (root / "model.safetensors").exists():
            with safe_open(root / "model.safetensors", "pt") as f:
                self._file = {name: root / "model.safetensors" for name in f.keys()}  # noqa: SIM118
        else:
            raise FileNotFoundError(
                f"{root}: no model.safetensors or model.safetensors.index.json; the megatron "
                "backend loads Hugging Face checkpoints saved as safetensors"
            )
        self._open: dict[Path, Any] = {}

    def _slice(self, name: str) -> Any:
        try:
            file = self._file[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in the checkpoint") from None
        if file not in self._open:
            self._open[file] = safe_open(file, "pt")
        return self._open[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, index: Index) -> torch.Tensor:
        part: torch.Tensor = self._slice(name)[index]
        return part


def megatron_mapping(model_path: str) -> MegatronMapping:
    """The Megatron mapping of a local checkpoint, by its installed model family."""
    from miles.core.registry.families import family_of_config, read_config

    config = read_config(model_path)
    if config is None:
        raise FileNotFoundError(
            f"{model_path}: no config.json; the megatron backend trains local Hugging Face "
            "checkpoints"
        )
    family = family_of_config(config)
    if family is None or family.megatron is None:
        from miles.megatron.checks import no_mapping

        raise ValueError(
            f"{model_path}: {no_mapping(family, config.get('model_type'))}; train it with "
            "train.backend: fsdp"
        )
    return family.megatron(config)


def checkpoint_source(model_path: str, mapping: MegatronMapping) -> WeightSource:
    """The checkpoint's weights under the names the mapping reads (transformers' in-memory
    names): its safetensors read a slice at a time where the names on disk are those; else (a
    format transformers converts on load, e.g. per-expert tensors it fuses) the model as
    transformers loads it, on the host."""
    from miles.megatron.convert import hf_names

    try:
        source = SafetensorsSource(model_path)
    except FileNotFoundError:
        source = None
    if source is not None and hf_names(mapping) <= set(source._file):
        return source
    from miles.torch.models import load_causal_lm

    model = load_causal_lm(model_path, dtype=torch.float32)
    return TensorSource(dict(model.state_dict()))
