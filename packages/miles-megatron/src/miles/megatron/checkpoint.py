"""Checkpoints of the `megatron` backend, and the weights loading they share with start-up.

The files are fsdp's: `model.safetensors` (the fp32 main weights as a Hugging Face checkpoint),
`optimizer.safetensors` (Adam's moments and step under Hugging Face names, "<name>/exp_avg",
...), config.json and the tokenizer's files, each rank's RNG state and `trainer_state.json`.
Everything is gathered from the shards into whole tensors (`ShardGather`), so a checkpoint holds
no layout and resumes at any TP / PP / EP / DP; loading reads each rank's slices back
(`convert.shard`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.core.contracts.family import MegatronMapping
from miles.megatron.config import MegatronConfig
from miles.megatron.convert import WeightSource, shard
from miles.megatron.gathering import ShardGather
from miles.megatron.layout import ParallelLayout, Rank
from miles.megatron.optimizer_state import MOMENTS, adam_states, gather_state, load_state
from miles.torch.train import checkpoint as ckpt

CHECKPOINT_FORMAT = 1
BACKEND = "megatron"


@torch.no_grad()
def load_weights(
    params: dict[str, torch.Tensor],
    optimizer: Any,
    source: WeightSource,
    mapping: MegatronMapping,
    layout: ParallelLayout,
    coords: Rank,
    state: Mapping[str, WeightSource] | None = None,
    step: int = 0,
) -> None:
    """The model's weights and the optimizer's fp32 main weights from Hugging Face weights
    (no rounding through bf16), and Adam's moments from `state` at `step` (None: zeros, a fresh
    optimizer)."""
    mine = shard(source, mapping, layout, coords)
    moments = {key: shard(src, mapping, layout, coords) for key, src in (state or {}).items()}
    missing = sorted(set(params) - set(mine))
    if missing:
        raise KeyError(f"the checkpoint's weights do not make {missing[:3]} of this rank")
    whole: dict[int, dict[str, torch.Tensor]] = {}
    for name, param in params.items():
        param.copy_(mine[name].to(param.dtype))
        entry = {"main": mine[name].float()}
        for key in MOMENTS:
            got = moments.get(key, {}).get(name)
            entry[key] = torch.zeros(param.shape) if got is None else got.float()
        whole[id(param)] = entry
    load_state(optimizer, whole, step if state else 0)
    if not state:  # a fresh optimizer: no moments, no steps yet
        for opt_state in adam_states(optimizer):
            opt_state.clear()


def save_checkpoint(
    path: str,
    *,
    optimizer: Any,
    params: dict[str, torch.Tensor],
    gathering: ShardGather,
    model_path: str,
    cfg: MegatronConfig,
    step: int,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    """Writes the checkpoint directory (atomically); collective: every rank gathers, rank 0
    writes the shared files, each rank its RNG state."""
    state = gather_state(optimizer)

    def local(key: str) -> Callable[[str], torch.Tensor]:
        def get(name: str) -> torch.Tensor:
            param = params[name]
            entry = state.get(id(param))
            if entry is None:  # a buffer (e.g. a router's expert bias): no optimizer state
                return param.float() if key == "main" else torch.zeros_like(param.float())
            return entry[key]

        return get

    with ckpt.atomic_directory(path, rank) as tmp:
        weights = {n: t.cpu() for n, t in gathering.named(local("main"), torch.float32)}
        optim: dict[str, torch.Tensor] = {}
        for key in MOMENTS:
            for name, t in gathering.named(local(key), torch.float32):
                optim[f"{name}/{key}"] = t.cpu()
        for name in weights:
            optim[f"{name}/step"] = torch.tensor(float(step))
        if rank == 0:
            trainer_state = {
                "format": CHECKPOINT_FORMAT,
                "backend": BACKEND,
                "step": step,
                "world_size": world_size,
                "config": dataclasses.asdict(cfg),
            }
            _write_shared_files(tmp, model_path, weights, optim, trainer_state)
        rng = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(device)
        save_file(rng, tmp / ckpt.rng_file(rank))


def _write_shared_files(
    tmp: Path,
    model_path: str,
    weights: dict[str, torch.Tensor],
    optim: dict[str, torch.Tensor],
    trainer_state: dict[str, Any],
) -> None:
    """Rank 0's part: the model, optimizer and trainer state, and the model's own files."""
    skeleton = _causal_lm_skeleton(model_path)
    on_disk = _on_disk(skeleton, weights)
    save_file(on_disk, tmp / ckpt.MODEL_FILE, metadata={"format": "pt"})
    save_file(optim, tmp / ckpt.OPTIMIZER_FILE)
    skeleton.config.save_pretrained(tmp)  # the trained model's, as fsdp writes it
    generation = Path(model_path) / "generation_config.json"
    if generation.is_file():
        (tmp / generation.name).write_bytes(generation.read_bytes())
    ckpt.copy_tokenizer_files(model_path, tmp)
    ckpt.write_json(tmp / ckpt.STATE_FILE, trainer_state)


def read_trainer_state(path: str) -> dict[str, Any]:
    """`trainer_state.json` of a checkpoint this backend can resume."""
    state: dict[str, Any] = json.loads((Path(path) / ckpt.STATE_FILE).read_text())
    if state["format"] != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: checkpoint format {state['format']}, expected 1")
    return state


def moment_sources(path: str, weights: WeightSource) -> dict[str, WeightSource]:
    """Adam's moments of a checkpoint as weight sources, by key ("exp_avg", "exp_avg_sq")."""
    file = Path(path) / ckpt.OPTIMIZER_FILE
    return {key: _SuffixSource(file, key, weights) for key in MOMENTS}


def load_rng(path: str, rank: int, device: torch.device) -> None:
    """This rank's RNG state, if the checkpoint has it."""
    rng_path = Path(path) / ckpt.rng_file(rank)
    if not rng_path.is_file():
        return
    with safe_open(str(rng_path), "pt") as f:
        torch.set_rng_state(f.get_tensor("cpu"))
        if device.type == "cuda" and "cuda" in f.keys():  # noqa: SIM118
            torch.cuda.set_rng_state(f.get_tensor("cuda"), device)


class _SuffixSource:
    """One optimizer state of `optimizer.safetensors` ("<name>/<key>") as a weight source; zeros
    shaped like `weights`' tensor for a name without one (a buffer, which no optimizer steps)."""

    def __init__(self, file: Path, key: str, weights: WeightSource) -> None:
        self._file, self._key, self._weights = safe_open(str(file), "pt"), key, weights
        self._names = set(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        if f"{name}/{self._key}" not in self._names:
            return self._weights.shape(name)
        return tuple(self._file.get_slice(f"{name}/{self._key}").get_shape())

    def read(self, name: str, index: Any) -> torch.Tensor:
        if f"{name}/{self._key}" not in self._names:
            return torch.zeros_like(self._weights.read(name, index), dtype=torch.float32)
        part: torch.Tensor = self._file.get_slice(f"{name}/{self._key}")[index]
        return part


def _causal_lm_skeleton(model_path: str) -> Any:
    """The Hugging Face causal LM of the checkpoint on the meta device (no weights): for a
    multimodal wrapper, its language model, the model Miles trains (as fsdp saves it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # no causal LM for the wrapper's class: its text model's
            return AutoModelForCausalLM.from_config(config.get_text_config())


def _on_disk(model: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Weights under the names `save_pretrained` writes (transformers' in-memory formats, e.g.
    fused MoE experts, reverted), for a checkpoint that loads like the original."""
    from transformers.core_model_loading import revert_weight_conversion

    out: dict[str, torch.Tensor] = revert_weight_conversion(model, weights)
    tied = getattr(model.config, "tie_word_embeddings", False)
    return {n: t.contiguous() for n, t in out.items() if not (tied and n == "lm_head.weight")}
