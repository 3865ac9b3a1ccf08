"""Hugging Face checkpoints as weight sources: each rank reads only the slices it holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from miles.megatron.convert import Index


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
