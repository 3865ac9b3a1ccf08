"""`fsdp`: the FSDP2 train backend, one `FSDPTrainer` per rank.

Data parallelism: every rank is handed the *whole* batch and takes its share itself. The batch is
split into micro-batches of at most `micro_batch_tokens` real tokens; rank r runs micro-batches
r, r + W, r + 2W, ... and ranks with fewer are topped up with zero-weight padding micro-batches,
because FSDP's collectives need every rank in every forward and backward. `logprobs` shares the
work the same way and all-reduces the results, so each rank returns the full arrays.

Gradients are summed over ranks, not averaged: `loss_weights` already fold the aggregation over
the global batch, so the summed gradient is exactly that of the one-shot global loss.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM

from miles.core.protocols import LossInputs, PolicyLoss
from miles.core.types import PackedBatch
from miles.torch.train import checkpoint as ckpt
from miles.torch.train.config import FSDPConfig
from miles.torch.train.logprobs import token_logprobs
from miles.torch.train.microbatch import MicroBatch, shard_micro_batches
from miles.torch.train.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from miles.torch.weights import named_state

CHECKPOINT_FORMAT = 1
_TRAINER_METRICS = ("train/loss", "train/entropy", "train/grad_norm", "train/lr")


class FSDPTrainer:
    """One rank of an FSDP2 training group over a Hugging Face causal LM.

    All methods except `sleep`/`wake` are collective: every rank must call them, in the same
    order and with the same arguments. The model stays in eval mode (no dropout), so the
    logprobs of a train step equal those `logprobs` recomputes.
    """

    def __init__(
        self,
        cfg: FSDPConfig,
        model_path: str,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        self.cfg, self.model_path = cfg, model_path
        self.rank, self.world_size = rank, world_size
        self.device = _resolve_device(device)
        self._owns_process_group = _init_process_group(
            self.device, master_addr, master_port, rank, world_size
        )
        torch.manual_seed(seed)
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        # Hugging Face models that fully_shard turned into FSDPModules as well.
        self.model: Any = self._build_model(model_path, trainable=True)
        self.ref_model: Any = (
            self._build_model(model_path, trainable=False) if cfg.ref_model else None
        )
        self.optimizer = build_optimizer(self.model.parameters(), cfg)
        self.step = 0  # optimizer steps taken; the LR schedule's whole state
        self._closed = False

    # -- model ------------------------------------------------------------------------------

    def _build_model(self, path: str, trainable: bool) -> torch.nn.Module:
        model = _load_hf_model(path, self.cfg.attn_implementation).eval()
        layers = _decoder_layers(model)
        if trainable:
            ids = {id(layer) for layer in layers}
            self._layer_prefixes = [f"{n}." for n, m in model.named_modules() if id(m) in ids]
        if not trainable:
            model.requires_grad_(False)
        elif self.cfg.activation_checkpointing:
            for layer in layers:
                _checkpoint_forward(layer)
        compute = None if self.cfg.dtype == "float32" else torch.bfloat16
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(
                layer,
                mesh=self.mesh,
                mp_policy=policy,
                reshard_after_forward=self.cfg.reshard_after_forward,
            )
        fully_shard(model, mesh=self.mesh, mp_policy=policy)
        for module in (*layers, model):
            assert isinstance(module, FSDPModule)
            # Sum gradients over ranks (see the module docstring) instead of averaging.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        return model

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    # -- forward passes ---------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch) -> dict[str, Any]:
        """{"logprobs", "entropy"[, "ref_logprobs"]}: fp32 numpy arrays aligned with batch.tokens.

        Each is 0 at every sequence's first token. Every rank passes the whole batch and gets
        the whole result.
        """
        rows = 3 if self.ref_model is not None else 2
        out = torch.zeros(rows, len(batch.tokens), dtype=torch.float32, device=self.device)
        for mb in self._micro_batches(batch):
            idx = torch.from_numpy(mb.token_index).to(self.device)
            lp, entropy = token_logprobs(self.model, mb, self.cfg.temperature)
            ref = None
            if self.ref_model is not None:
                ref, _ = token_logprobs(self.ref_model, mb, self.cfg.temperature)
            if not mb.is_padding:
                out[0, idx], out[1, idx] = lp, entropy
                if ref is not None:
                    out[2, idx] = ref
        for model in self._models():
            model.reshard()  # the root keeps its weights gathered after forward otherwise
        if self.world_size > 1:
            dist.all_reduce(out)  # each token was filled in by exactly one rank, 0 elsewhere
        arrays = out.cpu().numpy()
        result = {"logprobs": arrays[0], "entropy": arrays[1]}
        if self.ref_model is not None:
            result["ref_logprobs"] = arrays[2]
        return result

    def train_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]:
        """One optimizer step on the whole batch; every rank returns the same metrics.

        Reads `batch.loss_weights` (default: token mean over `loss_mask`), `batch.old_logprobs`
        (default: the current logprobs, detached: exact for the first step on fresh data, and it
        saves a forward) and `batch.ref_logprobs` (None when unset). Metrics: "train/loss" (the
        objective), "train/entropy" and every loss metric as loss-weighted means,
        "train/grad_norm" (before clipping) and "train/lr". A non-finite grad norm skips the
        update.
        """
        weights = batch.loss_weights
        if weights is None:
            weights = batch.loss_mask / max(float(batch.loss_mask.sum()), 1.0)
        sums: dict[str, torch.Tensor] = {}  # loss-weighted sums, this rank's share

        def add(key: str, value: torch.Tensor, w: torch.Tensor) -> None:
            total = (value.detach().float() * w).sum()
            sums[key] = sums[key] + total if key in sums else total

        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro_batches(batch):
            lp, entropy = token_logprobs(self.model, mb, self.cfg.temperature)
            inputs = self._loss_inputs(batch, weights, mb, lp, entropy)
            per_token, metrics = loss(inputs)
            (per_token * inputs.loss_weights).sum().backward()
            add("train/loss", per_token, inputs.loss_weights)
            add("train/entropy", entropy, inputs.loss_weights)
            for key, value in metrics.items():
                key = key if key.startswith("train/") else f"train/{key}"
                if key in _TRAINER_METRICS:
                    raise ValueError(f"loss metric {key!r} clashes with the trainer's own")
                add(key, value, inputs.loss_weights)

        keys = sorted(sums)
        totals = torch.stack([sums[k] for k in keys])
        if self.world_size > 1:
            dist.all_reduce(totals)
        grad_norm = clip_grad_norm_(self._trainable(), self.cfg.grad_clip)
        lr = lr_at(self.cfg, self.step)
        if math.isfinite(grad_norm):
            set_lr(self.optimizer, lr)
            self.optimizer.step()
            self.step += 1
        self.optimizer.zero_grad(set_to_none=True)

        total_weight = float(np.sum(weights, dtype=np.float64)) or 1.0
        out = {
            k: float(v) / (1.0 if k == "train/loss" else total_weight)
            for k, v in zip(keys, totals.tolist(), strict=True)
        }
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out

    def _micro_batches(self, batch: PackedBatch) -> list[MicroBatch]:
        return shard_micro_batches(
            batch, self.cfg.micro_batch_tokens, self.rank, self.world_size, self.device
        )

    def _loss_inputs(
        self,
        batch: PackedBatch,
        weights: npt.NDArray[np.float32],
        mb: MicroBatch,
        lp: torch.Tensor,
        entropy: torch.Tensor,
    ) -> LossInputs:
        def take(array: npt.NDArray[np.float32] | None) -> torch.Tensor | None:
            return None if array is None else self._per_token(array, mb)

        w = self._per_token(weights, mb)
        old = take(batch.old_logprobs)
        return LossInputs(
            logprobs=lp,
            old_logprobs=lp.detach() if old is None else old,
            rollout_logprobs=self._per_token(batch.rollout_logprobs, mb),
            advantages=self._per_token(batch.advantages, mb),
            loss_mask=self._per_token(batch.loss_mask, mb),
            loss_weights=torch.zeros_like(w) if mb.is_padding else w,
            entropy=entropy,
            ref_logprobs=take(batch.ref_logprobs),
            seq_index=mb.seq_index,
        )

    def _per_token(self, array: npt.NDArray[np.floating[Any]], mb: MicroBatch) -> torch.Tensor:
        values = np.ascontiguousarray(array[mb.token_index], dtype=np.float32)
        return torch.from_numpy(values).to(self.device)

    # -- weights and checkpoints -------------------------------------------------------------

    @torch.no_grad()
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter and persistent buffer, fp32, on this device.

        Names are the unwrapped Hugging Face model's `state_dict()` names; tied weights appear
        once (under the first name, e.g. model.embed_tokens.weight). Collective: every rank must
        iterate to the end, since each tensor is all-gathered.
        """
        for name, tensor in self._named_state():
            yield name, ckpt.full_tensor(tensor)

    def _named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        return named_state(self.model)

    def _groups(self) -> list[list[tuple[str, torch.Tensor]]]:
        """Parameters and buffers grouped by decoder layer (the rest in one group).

        A weight-format conversion (fused MoE experts back to per-expert tensors) never spans
        layers, so a group is a unit of conversion as well as of memory.
        """
        prefixes = self._layer_prefixes
        groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in self._named_state():
            key = next((p for p in prefixes if name.startswith(p)), "")
            groups.setdefault(key, []).append((name, tensor))
        return list(groups.values())

    def save(self, path: str) -> None:
        """Write a checkpoint directory (see `checkpoint`): weights, optimizer, RNG, step."""
        from transformers.core_model_loading import revert_weight_conversion

        with ckpt.atomic_directory(path, self.rank) as tmp:
            weights: dict[str, torch.Tensor] = {}
            for group in self._groups():
                full = {name: ckpt.full_tensor(t) for name, t in group}
                if self.rank == 0:
                    # The checkpoint's on-disk names, as save_pretrained writes them.
                    for name, t in revert_weight_conversion(self.model, full).items():
                        weights[name] = t.detach().cpu().contiguous()
            optim: dict[str, torch.Tensor] = {}
            for name, param in self.model.named_parameters():
                for key, value in self.optimizer.state.get(param, {}).items():
                    gathered = ckpt.full_tensor(value)
                    if self.rank == 0:
                        optim[f"{name}/{key}"] = gathered.cpu().contiguous()
            rng = {"cpu": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            save_file(rng, tmp / ckpt.rng_file(self.rank))
            if self.rank == 0:
                save_file(weights, tmp / ckpt.MODEL_FILE, metadata={"format": "pt"})
                save_file(optim, tmp / ckpt.OPTIMIZER_FILE)
                self.model.config.save_pretrained(tmp)
                if self.model.generation_config is not None:
                    self.model.generation_config.save_pretrained(tmp)
                ckpt.copy_tokenizer_files(self.model_path, tmp)
                state = {
                    "format": CHECKPOINT_FORMAT,
                    "step": self.step,
                    "world_size": self.world_size,
                    "config": dataclasses.asdict(self.cfg),
                }
                ckpt.write_json(tmp / ckpt.STATE_FILE, state)

    @torch.no_grad()
    def load(self, path: str) -> None:
        """Restore a `save`d checkpoint: weights, optimizer state, step, and (same world size)
        RNG. The config is this trainer's own; the reference model stays the one at model_path.
        """
        root = Path(path)
        state = json.loads((root / ckpt.STATE_FILE).read_text())
        if state["format"] != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {state['format']}, expected 1")
        # from_pretrained undoes the on-disk weight format (e.g. fuses MoE experts) for us.
        source = _load_hf_model(path, self.cfg.attn_implementation)
        full = dict(source.state_dict())
        for name, tensor in self._named_state():
            tensor.copy_(ckpt.shard_like(full[name], tensor))
        del source, full

        self.optimizer.state.clear()
        with safe_open(str(root / ckpt.OPTIMIZER_FILE), framework="pt") as f:
            keys = set(f.keys())
            for name, param in self.model.named_parameters():
                entries = {k.split("/", 1)[1] for k in keys if k.startswith(name + "/")}
                st: dict[str, torch.Tensor] = {}
                for key in entries:
                    value = f.get_tensor(f"{name}/{key}")
                    # "step" is a CPU scalar in AdamW; moments are shaped and sharded like the param.
                    st[key] = value if key == "step" else ckpt.shard_like(value, param)
                if st:
                    self.optimizer.state[param] = st
        self.step = int(state["step"])
        rng_path = root / ckpt.rng_file(self.rank)
        if state["world_size"] == self.world_size and rng_path.is_file():
            states = load_file(rng_path)
            torch.set_rng_state(states["cpu"])
            if self.device.type == "cuda" and "cuda" in states:
                torch.cuda.set_rng_state(states["cuda"], self.device)

    # -- memory ---------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Move weights and optimizer state to CPU, freeing GPU memory for the rollout engine.

        On a CPU trainer there is nothing to free: a no-op.
        """
        self._move_to(torch.device("cpu"))

    def wake(self) -> None:
        """Undo `sleep`. A no-op on a CPU trainer."""
        self._move_to(self.device)

    def _move_to(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        for model in self._models():
            model.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(device, non_blocking=True)
        torch.cuda.synchronize(self.device)
        if device.type == "cpu":
            torch.cuda.empty_cache()

    def _models(self) -> list[Any]:
        return [self.model] + ([self.ref_model] if self.ref_model is not None else [])

    def close(self) -> None:
        """Free the model and optimizer, and the process group if this trainer created it.

        Collective. The trainer is unusable afterwards.
        """
        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            dist.barrier()
        # Drop the sharded modules now: their FSDP state holds collective work objects, and
        # gloo can abort the process if those are only freed at interpreter exit.
        del self.optimizer, self.ref_model, self.model, self.mesh
        gc.collect()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


# -- helpers ------------------------------------------------------------------------------------


def _resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def _init_process_group(
    device: torch.device, addr: str, port: int, rank: int, world_size: int
) -> bool:
    """Join (or reuse) the default process group; True if this call created it."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"process group already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not {rank} of {world_size}"
            )
        return False
    # CPU collectives (barriers, checkpoint sync) go over gloo even on GPU trainers.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size
    )
    return True


def _load_hf_model(path: str, attn_implementation: str) -> torch.nn.Module:
    # fp32 master weights on CPU; fully_shard moves each rank's shard to the mesh's device.
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules Hugging Face marks as unsplittable (the decoder layers): one FSDP unit each."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules to shard by")
    return layers


def _checkpoint_forward(layer: torch.nn.Module) -> None:
    """Recompute `layer` in backward. It stays inside the layer's FSDP unit: the recompute runs
    while FSDP has the layer's weights gathered for its backward."""
    inner = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    layer.forward = forward
