"""`fsdp`: the FSDP2 train backend, one `FSDPTrainer` per rank.

Data parallelism: every rank is handed the *whole* batch and takes its share itself. The batch is
split into micro-batches of at most `micro_batch_tokens` real tokens; rank r runs micro-batches
r, r + W, r + 2W, ... and ranks with fewer are topped up with zero-weight padding micro-batches,
because FSDP's collectives need every rank in every forward and backward. `logprobs` shares the
work the same way and all-reduces the results, so each rank returns the full arrays.

Gradients are summed over ranks, not averaged: `loss_weights` already fold the aggregation over
the global batch, so the summed gradient is exactly that of the one-shot global loss.

With `TrainSetup.critic`, a value model (the same checkpoint with a one-output token-classification
head) is sharded, checkpointed, slept and woken just like the policy, and trained by
`train_value_step` with its own optimizer and step count.

Weight sync (the plan, the broadcast or in-place transfer, the checksum) is `WeightSender`'s, over
this trainer's full tensors under their Hugging Face names.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from miles.core.backends import BucketDelivery, LogprobResult, TrainSetup
from miles.core.config import ReplayMode
from miles.core.protocols import LossInputs, PolicyLoss
from miles.core.types import PackedBatch
from miles.core.weight_sync import SyncPlan
from miles.precision.lora import apply_lora, merge_named
from miles.torch.models import load_causal_lm
from miles.torch.routing import RoutingReplay, router_adapter
from miles.torch.sync.sender import WeightSender, WeightView
from miles.torch.train import checkpoint as ckpt
from miles.torch.train import packed_attention, profiling
from miles.torch.train.checks import family_of_checkpoint, packs_sequences
from miles.torch.train.config import FSDPConfig, schedule_problem
from miles.torch.train.distributed import init_process_group, resolve_device
from miles.torch.train.host_adamw import HostAdamW
from miles.torch.train.layers import compile_layer, decoder_layers, recompute_in_backward
from miles.torch.train.logprobs import token_logprobs
from miles.torch.train.microbatch import (
    MicroBatch,
    batch_loss_weights,
    loss_inputs,
    per_token,
    shard_micro_batches,
)
from miles.torch.train.optim import build_optimizer, clip_grad_norm_, lr_at, set_lr
from miles.torch.train.rms_norm import fuse_rms_norms
from miles.torch.train.values import load_critic, token_values
from miles.torch.weights import named_state

CHECKPOINT_FORMAT = 1
_TRAINER_METRICS = ("train/loss", "train/entropy", "train/grad_norm", "train/lr")
_CRITIC_METRICS = ("critic/loss", "critic/grad_norm", "critic/lr")
CRITIC_DIR = "critic"  # the critic's checkpoint, a subdirectory of the trainer's


class FSDPTrainer:
    """One rank of an FSDP2 training group over a Hugging Face causal LM.

    All methods except `sleep`/`wake` are collective: every rank must call them, in the same
    order and with the same arguments. The model stays in eval mode (no dropout), so the
    logprobs of a train step equal those `logprobs` recomputes.
    """

    def __init__(self, cfg: FSDPConfig, setup: TrainSetup) -> None:
        total_steps = cfg.total_steps or setup.total_steps
        if cfg.lr_schedule != "constant" and total_steps <= cfg.warmup_steps:
            raise ValueError(schedule_problem(cfg, total_steps))
        self.cfg = dataclasses.replace(cfg, total_steps=total_steps)
        self.setup, self.model_path = setup, setup.model_path
        self.rank, self.world_size = setup.rank, setup.world_size
        self.lora, self.temperature = setup.lora, setup.temperature
        self.device = resolve_device(setup.device)
        if self.device.type == "cpu" and setup.cpu_threads:
            torch.set_num_threads(setup.cpu_threads)
        self._owns_process_group = init_process_group(
            self.device, setup.master_addr, setup.master_port, self.rank, self.world_size
        )
        torch.manual_seed(setup.seed)
        seed, model_path = setup.seed, setup.model_path
        self.packed = packs_sequences(cfg.packing, model_path)
        family = family_of_checkpoint(model_path)
        self._rms_norms = () if family is None else family.rms_norms
        self._family_compiles = family is not None and family.compile_layers
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Hugging Face models that fully_shard turned into FSDPModules as well.
        self.model: Any
        self.model, self._layer_prefixes = self._build_model(model_path, trainable=True)
        self.ref_model: Any = None
        self._ref_shards: list[torch.Tensor] | None = None
        if setup.reference and cfg.ref_mode == "copy":
            self.ref_model = self._build_model(model_path, trainable=False)[0]
        elif setup.reference:  # "offload": this rank's shards of the initial weights, on the host
            self._ref_shards = [_host_copy(_local(p)) for p in self.model.parameters()]
        self.optimizer = build_optimizer(self.model.parameters(), cfg)
        self.replay = _routing_replay(self.model, setup.routing_replay)
        self.step = 0  # optimizer steps taken; the LR schedule's whole state
        # The critic, if any: its own optimizer and step count (its steps may be skipped apart
        # from the policy's), on the policy's LR schedule scaled to `critic_lr`.
        self.critic: Any = None
        self.critic_optimizer: torch.optim.AdamW | None = None
        self.critic_step = 0
        self.critic_lr = cfg.lr if cfg.critic_lr is None else cfg.critic_lr
        if setup.critic:
            self.critic, self._critic_layer_prefixes = self._build_model(
                model_path, trainable=True, critic=True, seed=seed
            )
            self.critic_optimizer = build_optimizer(self.critic.parameters(), cfg, self.critic_lr)
        self.weights = WeightSender(self.named_weights, setup, self.device)
        self._closed = False

    # -- model ------------------------------------------------------------------------------

    def _build_model(
        self, path: str, trainable: bool, critic: bool = False, seed: int = 0
    ) -> tuple[torch.nn.Module, list[str]]:
        """The sharded model and its decoder layers' name prefixes (see `_groups`)."""
        attn = self._attention()
        model = (load_critic(path, attn, seed) if critic else _load_hf_model(path, attn)).eval()
        if not critic:  # a precision's own layers (e.g. fp8 / int4 training linears)
            _check_converted(self.setup, self.setup.precision.convert_model(model))
        compiled = self._compiles()
        if not compiled:  # Inductor fuses the norms of a compiled layer itself
            fuse_rms_norms(model, self._rms_norms, self.device)
        if trainable and not critic and self.lora is not None:
            apply_lora(model, self.lora)  # base frozen; adapters train
            if self.cfg.dtype == "bfloat16":
                # Nothing updates the frozen base, so it needs no fp32 master: held in bf16 it
                # computes the same numbers (FSDP casts it to bf16 anyway) at half the memory.
                for p in model.parameters():
                    if not p.requires_grad and p.dtype == torch.float32:
                        p.data = p.data.to(torch.bfloat16)
        layers = decoder_layers(model)
        ids = {id(layer) for layer in layers}
        prefixes = [f"{n}." for n, m in model.named_modules() if id(m) in ids]
        if not trainable:
            model.requires_grad_(False)
        elif self.cfg.activation_checkpointing:
            for layer in layers:
                recompute_in_backward(layer)
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
        for layer in layers if compiled else ():  # after sharding: measured faster than before
            compile_layer(layer, fallback=self.cfg.compile == "auto")
        for module in (*layers, model):
            assert isinstance(module, FSDPModule)
            # Sum gradients over ranks (see the module docstring) instead of averaging.
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        return model, prefixes

    def _compiles(self) -> bool:
        return self.cfg.compile == "on" or (
            self.cfg.compile == "auto" and self.device.type == "cuda" and self._family_compiles
        )

    def _attention(self) -> str:
        return packed_attention.NAME if self.packed else self.cfg.attn_implementation

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _require_critic(self) -> Any:
        if self.critic is None:
            raise RuntimeError("this trainer has no critic: build it with TrainSetup(critic=True)")
        return self.critic

    # -- forward passes ---------------------------------------------------------------------

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch) -> LogprobResult:
        """Logprobs, entropy (and reference logprobs): fp32 arrays aligned with batch.tokens,
        0 at every sequence's first token; with MoE routing records, the routers' agreement
        with them. Every rank passes the whole batch and gets the whole result.
        """
        has_ref = self.ref_model is not None or self._ref_shards is not None
        rows = 3 if has_ref else 2
        out = torch.zeros(rows, len(batch.tokens), dtype=torch.float32, device=self.device)
        micro_batches = self._micro_batches(batch)
        for mb in micro_batches:
            idx = torch.from_numpy(mb.token_index).to(self.device)
            with self._replaying(mb, count=not mb.is_padding):
                lp, entropy = token_logprobs(self.model, mb, self.temperature)
            ref = None
            if self.ref_model is not None:
                ref, _ = token_logprobs(self.ref_model, mb, self.temperature)
            if not mb.is_padding:
                out[0, idx], out[1, idx] = lp, entropy
                if ref is not None:
                    out[2, idx] = ref
        for model in self._models():
            model.reshard()  # the root keeps its weights gathered after forward otherwise
        if self._ref_shards is not None:
            with self._reference_weights():
                for mb in micro_batches:
                    ref, _ = token_logprobs(self.model, mb, self.temperature)
                    if not mb.is_padding:
                        out[2, torch.from_numpy(mb.token_index).to(self.device)] = ref
                self.model.reshard()
        if self.world_size > 1:
            dist.all_reduce(out)  # each token was filled in by exactly one rank, 0 elsewhere
        arrays = out.cpu().numpy()
        return LogprobResult(
            logprobs=arrays[0],
            entropy=arrays[1],
            ref_logprobs=arrays[2] if has_ref else None,
            metrics=self._routing_metrics(),
        )

    @contextmanager
    def _reference_weights(self) -> Iterator[None]:
        """Swaps the offloaded reference shards into the policy model, and back afterwards.

        Copies go into the shards' storage in place, so FSDP's all-gathers see them; the
        policy's shards wait in host memory meanwhile.
        """
        assert self._ref_shards is not None
        params = [_local(p) for p in self.model.parameters()]
        saved = [_host_copy(p) for p in params]
        try:
            for p, ref in zip(params, self._ref_shards, strict=True):
                p.copy_(ref, non_blocking=True)
            yield
        finally:
            for p, policy in zip(params, saved, strict=True):
                p.copy_(policy, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    @torch.no_grad()
    def values(self, batch: PackedBatch) -> npt.NDArray[np.float32]:
        """The critic's values, fp32 aligned with batch.tokens: values[t] is the critic's output
        at position t - 1 (the state before token t), 0 at every sequence's first token.

        Collective like `logprobs`: every rank passes the whole batch and gets the whole result.
        """
        critic = self._require_critic()
        out = torch.zeros(len(batch.tokens), dtype=torch.float32, device=self.device)
        for mb in self._micro_batches(batch):
            v = token_values(critic, mb)
            if not mb.is_padding:
                out[torch.from_numpy(mb.token_index).to(self.device)] = v
        critic.reshard()
        if self.world_size > 1:
            dist.all_reduce(out)  # each token was filled in by exactly one rank, 0 elsewhere
        return out.cpu().numpy()

    def train_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]:
        """One optimizer step on the whole batch; every rank returns the same metrics.

        Reads `batch.loss_weights` (default: token mean over `loss_mask`), `batch.old_logprobs`
        (default: the current logprobs, detached: exact for the first step on fresh data, and it
        saves a forward) and `batch.ref_logprobs` (None when unset). Metrics: "train/loss" (the
        objective), "train/entropy" and every loss metric as loss-weighted means,
        "train/grad_norm" (before clipping) and "train/lr". A non-finite grad norm skips the
        update.
        """
        weights = batch_loss_weights(batch)
        sums: dict[str, torch.Tensor] = {}  # loss-weighted sums, this rank's share

        def add(key: str, value: torch.Tensor, w: torch.Tensor) -> None:
            total = (value.detach().float() * w).sum()
            sums[key] = sums[key] + total if key in sums else total

        self.weights.weights_changed()
        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro_batches(batch):
            # Replay stays on through backward: recomputed layers route the same way.
            with self._replaying(mb):
                lp, entropy = token_logprobs(self.model, mb, self.temperature)
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

        out = self._reduce_metrics(sums, weights, "train/loss")
        lr = lr_at(self.cfg, self.step)
        grad_norm = self._optimizer_step(self._trainable(), self.optimizer, lr)
        if math.isfinite(grad_norm):
            self.step += 1
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out

    def train_value_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]:
        """One critic optimizer step on the whole batch; every rank returns the same metrics.

        `loss` is a value loss: it gets `LossInputs.values` (the critic's current values, with
        gradient), `old_values` (`batch.values`; default: the current values, detached) and
        `returns` (`batch.returns`, required). The policy fields carry the batch's data without a
        policy forward: `logprobs` = `old_logprobs` = `batch.old_logprobs` (default: the rollout
        logprobs), no gradient, and `entropy` is 0, so a value loss must not read them.
        Weights are `batch.loss_weights` (default: token mean over `loss_mask`). Metrics:
        "critic/loss", every loss metric renamed "train/x" -> "critic/x" as a loss-weighted mean,
        "critic/grad_norm" (before clipping) and "critic/lr". A non-finite grad norm skips the
        update.
        """
        critic = self._require_critic()
        assert self.critic_optimizer is not None
        if batch.returns is None:
            raise ValueError("train_value_step needs batch.returns")
        weights = batch_loss_weights(batch)
        sums: dict[str, torch.Tensor] = {}

        def add(key: str, value: torch.Tensor, w: torch.Tensor) -> None:
            total = (value.detach().float() * w).sum()
            sums[key] = sums[key] + total if key in sums else total

        policy_lp = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
        self.critic_optimizer.zero_grad(set_to_none=True)
        for mb in self._micro_batches(batch):
            v = token_values(critic, mb)
            lp = self._per_token(policy_lp, mb)
            inputs = self._loss_inputs(batch, weights, mb, lp, torch.zeros_like(lp))
            old = batch.values
            inputs.values = v
            inputs.old_values = v.detach() if old is None else self._per_token(old, mb)
            inputs.returns = self._per_token(batch.returns, mb)
            per_token, metrics = loss(inputs)
            (per_token * inputs.loss_weights).sum().backward()
            add("critic/loss", per_token, inputs.loss_weights)
            for key, value in metrics.items():
                key = f"critic/{key.removeprefix('train/')}"
                if key in _CRITIC_METRICS:
                    raise ValueError(f"loss metric {key!r} clashes with the trainer's own")
                add(key, value, inputs.loss_weights)

        out = self._reduce_metrics(sums, weights, "critic/loss")
        lr = lr_at(self.cfg, self.critic_step, self.critic_lr)
        params = [p for p in critic.parameters() if p.requires_grad]
        grad_norm = self._optimizer_step(params, self.critic_optimizer, lr)
        if math.isfinite(grad_norm):
            self.critic_step += 1
        out["critic/grad_norm"] = grad_norm
        out["critic/lr"] = lr
        return out

    def _reduce_metrics(
        self, sums: dict[str, torch.Tensor], weights: npt.NDArray[np.float32], loss_key: str
    ) -> dict[str, float]:
        """All-reduce the loss-weighted sums; every metric but the loss (already a weighted sum
        of the global objective) becomes a loss-weighted mean."""
        keys = sorted(sums)
        totals = torch.stack([sums[k] for k in keys])
        if self.world_size > 1:
            dist.all_reduce(totals)
        total_weight = float(np.sum(weights, dtype=np.float64)) or 1.0
        return {
            k: float(v) / (1.0 if k == loss_key else total_weight)
            for k, v in zip(keys, totals.tolist(), strict=True)
        }

    def _optimizer_step(
        self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, lr: float
    ) -> float:
        """Clip, then step at `lr` unless the grad norm is non-finite; returns the grad norm."""
        grad_norm = clip_grad_norm_(params, self.cfg.grad_clip)
        if math.isfinite(grad_norm):
            set_lr(optimizer, lr)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    @contextmanager
    def _replaying(self, mb: MicroBatch, count: bool = False) -> Iterator[None]:
        """Routes `mb` through its recorded experts (MoE with routing replay; else a no-op)."""
        if self.replay is None or mb.routing is None:
            yield
            return
        self.replay.counting = count
        try:
            with self.replay.active(mb.routing, mb.routing_weights):
                yield
        finally:
            self.replay.counting = False

    def _routing_metrics(self) -> dict[str, float]:
        """Agreement of the trainer's own routers with the rollout record over the last
        `logprobs` call (collective); {} for a model without MoE routers or records."""
        if self.replay is None:
            return {}
        stats = self.replay.take_stats()
        counts = torch.tensor(
            [stats.compared, stats.agreed, stats.replayed_tokens, stats.matched],
            dtype=torch.float64,
        )
        if self.world_size > 1:
            counts = counts.to(self.device)
            dist.all_reduce(counts)
        compared, agreed, replayed, matched = counts.tolist()
        if not compared:
            return {}
        metrics = {"moe/routing_agreement": agreed / compared, "moe/replayed_tokens": replayed}
        if self.replay.mode != "off" and self.replay.verifies:
            # Counted at the experts modules' inputs: 1.0 only if what the experts received
            # was the record; below it when replay did not take hold.
            metrics["moe/replayed_match"] = matched / compared
        return metrics

    def _micro_batches(self, batch: PackedBatch) -> list[MicroBatch]:
        return shard_micro_batches(
            batch,
            self.cfg.micro_batch_tokens,
            self.rank,
            self.world_size,
            self.device,
            packed=self.packed,
        )

    def _loss_inputs(
        self,
        batch: PackedBatch,
        weights: npt.NDArray[np.float32],
        mb: MicroBatch,
        lp: torch.Tensor,
        entropy: torch.Tensor,
    ) -> LossInputs:
        return loss_inputs(batch, weights, mb, lp, entropy, self.device)

    def _per_token(self, array: npt.NDArray[np.floating[Any]], mb: MicroBatch) -> torch.Tensor:
        return per_token(array, mb, self.device)

    # -- weights and checkpoints -------------------------------------------------------------

    @torch.no_grad()
    def named_weights(self, view: WeightView = "sync") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter and persistent buffer, fp32, on this device.

        Names are the unwrapped Hugging Face model's `state_dict()` names; tied weights appear
        once (under the first name, e.g. model.embed_tokens.weight). With LoRA, view "sync" is
        what `lora.sync` says (base + adapters under the base names, or the adapters alone),
        "merged" base + adapters, "base" the frozen base alone. Collective: every rank must
        iterate to the end, since each tensor is all-gathered.
        """
        full = ((name, ckpt.full_tensor(t)) for name, t in self._named_state())
        if self.lora is None:
            yield from full
        elif view == "base":  # the frozen base under its own names, adapters left out
            for name, tensor in full:
                if ".lora_" not in name:
                    yield name.replace(".base.", "."), tensor
        elif view == "merged" or self.lora.sync == "merged":
            yield from merge_named(full, self.lora.scaling)
        else:
            yield from ((n, t) for n, t in full if ".lora_" in n)

    # Weight sync (see `WeightSender`): every call is collective.

    def weight_sync_plan(self, bucket_bytes: int) -> SyncPlan:
        return self.weights.plan(bucket_bytes)

    def join_weight_sync(self, host: str, port: int, world_size: int) -> None:
        self.weights.join(host, port, world_size)

    def leave_weight_sync(self) -> None:
        self.weights.close()

    def send_weights(self, plan: SyncPlan) -> int:
        return self.weights.send(plan)

    def profiled(self, path: str) -> AbstractContextManager[None]:
        return profiling.profiled(path, self.device)

    def send_weights_in_place(self, plan: SyncPlan, deliver: BucketDelivery | None) -> int:
        return self.weights.send_in_place(plan, deliver)

    def weights_checksum(self, dtype: str | None) -> str:
        return self.weights.checksum(dtype)

    def _named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        return named_state(self.model)

    def _groups(
        self, model: torch.nn.Module, prefixes: list[str]
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

    def _trained(self) -> list[tuple[Any, torch.optim.Optimizer, list[str], Path]]:
        """(model, optimizer, layer prefixes, checkpoint subdirectory) of each trained model."""
        out: list[tuple[Any, torch.optim.Optimizer, list[str], Path]] = [
            (self.model, self.optimizer, self._layer_prefixes, Path("."))
        ]
        if self.critic is not None:
            assert self.critic_optimizer is not None
            out.append(
                (self.critic, self.critic_optimizer, self._critic_layer_prefixes, Path(CRITIC_DIR))
            )
        return out

    def save(self, path: str) -> None:
        """Write a checkpoint directory (see `checkpoint`): weights, optimizer, RNG, step; and
        the critic's weights and optimizer under `critic/` (a Hugging Face token-classification
        checkpoint of its own)."""
        with ckpt.atomic_directory(path, self.rank) as tmp:
            for model, optimizer, prefixes, sub in self._trained():
                if model is self.model and self.lora is not None:
                    weights = self._gather_adapters()  # the base is model.path, unchanged
                else:
                    weights = self._gather_weights(model, prefixes)
                optim = ckpt.gather_optimizer(model, optimizer, self.rank)
                if self.rank == 0:
                    out = tmp / sub
                    out.mkdir(exist_ok=True)
                    lora = model is self.model and self.lora is not None
                    weights_file = ADAPTER_FILE if lora else ckpt.MODEL_FILE
                    save_file(weights, out / weights_file, metadata={"format": "pt"})
                    save_file(optim, out / ckpt.OPTIMIZER_FILE)
                    model.config.save_pretrained(out)
            rng = {"cpu": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            save_file(rng, tmp / ckpt.rng_file(self.rank))
            if self.rank == 0:
                if self.model.generation_config is not None:
                    self.model.generation_config.save_pretrained(tmp)
                ckpt.copy_tokenizer_files(self.model_path, tmp)
                state = {
                    "format": CHECKPOINT_FORMAT,
                    "step": self.step,
                    "world_size": self.world_size,
                    "config": dataclasses.asdict(self.cfg),
                }
                if self.critic is not None:
                    state["critic_step"] = self.critic_step
                ckpt.write_json(tmp / ckpt.STATE_FILE, state)

    def _gather_adapters(self) -> dict[str, torch.Tensor]:
        """The LoRA adapters' full tensors on rank 0 (empty elsewhere). Collective."""
        out: dict[str, torch.Tensor] = {}
        for name, tensor in named_state(self.model):
            if ".lora_" in name:
                full = ckpt.full_tensor(tensor)
                if self.rank == 0:
                    out[name] = full.detach().cpu().contiguous()
        return out

    def _gather_weights(self, model: Any, prefixes: list[str]) -> dict[str, torch.Tensor]:
        """`model`'s full weights under their on-disk names, as save_pretrained writes them; on
        rank 0 only (empty elsewhere). Collective."""
        from transformers.core_model_loading import revert_weight_conversion

        weights: dict[str, torch.Tensor] = {}
        for group in self._groups(model, prefixes):
            full = {name: ckpt.full_tensor(t) for name, t in group}
            if self.rank == 0:
                for name, t in revert_weight_conversion(model, full).items():
                    weights[name] = t.detach().cpu().contiguous()
        return weights

    @torch.no_grad()
    def load(self, path: str) -> None:
        """Restore a `save`d checkpoint: weights, optimizer state, step, (same world size) RNG,
        and the critic's weights, optimizer state and step when this trainer has a critic. The
        config is this trainer's own; the reference model stays the one at model_path.
        """
        root = Path(path)
        self.weights.weights_changed()
        state = json.loads((root / ckpt.STATE_FILE).read_text())
        if state["format"] != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {state['format']}, expected 1")
        if self.critic is not None and "critic_step" not in state:
            raise ValueError(f"{path}: checkpoint has no critic, but this trainer trains one")
        attn = self._attention()
        for model, optimizer, _, sub in self._trained():
            if model is self.model and self.lora is not None:
                adapters = load_file(root / sub / ADAPTER_FILE)
                for name, tensor in named_state(model):
                    if ".lora_" in name:
                        tensor.copy_(ckpt.shard_like(adapters[name], tensor))
                ckpt.load_optimizer(model, optimizer, root / sub / ckpt.OPTIMIZER_FILE)
                continue
            # from_pretrained undoes the on-disk weight format (e.g. fuses MoE experts) for us.
            is_critic = model is self.critic
            source = (load_critic if is_critic else _load_hf_model)(str(root / sub), attn)
            full = dict(source.state_dict())
            for name, tensor in named_state(model):
                tensor.copy_(ckpt.shard_like(full[name], tensor))
            del source, full
            ckpt.load_optimizer(model, optimizer, root / sub / ckpt.OPTIMIZER_FILE)
        for _, optimizer, _, _ in self._trained():
            if isinstance(optimizer, HostAdamW):
                optimizer.to_host()  # loaded onto the device, they rest on the host
        self.step = int(state["step"])
        self.critic_step = int(state.get("critic_step", 0))
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
        for _, optimizer, _, _ in self._trained():
            if isinstance(optimizer, HostAdamW):
                continue  # its moments rest on the host already
            for state in optimizer.state.values():
                for key, value in state.items():
                    if key != "step" and isinstance(value, torch.Tensor):
                        state[key] = value.to(device, non_blocking=True)
        torch.cuda.synchronize(self.device)
        if device.type == "cpu":
            torch.cuda.empty_cache()

    def _models(self) -> list[Any]:
        models = [self.model]
        if self.ref_model is not None:
            models.append(self.ref_model)
        if self.critic is not None:
            models.append(self.critic)
        return models

    def close(self) -> None:
        """Free the models and optimizers, and the process group if this trainer created it.

        Collective. The trainer is unusable afterwards.
        """
        if self._closed:
            return
        self._closed = True
        self.weights.close()
        if dist.is_initialized():
            dist.barrier()
        # Drop the sharded modules now: their FSDP state holds collective work objects, and
        # gloo can abort the process if those are only freed at interpreter exit.
        del self.optimizer, self.ref_model, self.model, self.mesh
        del self.critic_optimizer, self.critic, self.weights
        gc.collect()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


# -- helpers ------------------------------------------------------------------------------------


ADAPTER_FILE = "adapter.safetensors"  # with LoRA, the checkpoint's only model weights


def _check_converted(setup: TrainSetup, converted: int) -> None:
    """A quantized precision (one with a weight format of its own) that converted no layer
    would train in full precision while the engines get its format: refuse, rather than run
    silently without the numerics it promises."""
    if converted == 0 and setup.quantized:
        precision = setup.precision
        raise ValueError(
            f"precision {getattr(precision, 'name', type(precision).__name__)!r} converted no "
            "layer of the training model: "
            "training would not run in its format while engines receive it"
        )


def _routing_replay(model: Any, mode: ReplayMode) -> RoutingReplay | None:
    """A RoutingReplay over `model`'s MoE routers (with mode "off" it only measures agreement);
    None for a model without a router adapter (replay on such a model is refused before launch)."""
    adapter = router_adapter(model, f"routing_replay={mode!r}")
    return None if adapter is None else RoutingReplay(model, adapter, mode)


def _load_hf_model(path: str, attn_implementation: str) -> torch.nn.Module:
    # fp32 master weights on CPU; fully_shard moves each rank's shard to the mesh's device.
    model: torch.nn.Module = load_causal_lm(
        path, dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (DTensor) parameter, sharing its storage."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return out.copy_(t.detach())
