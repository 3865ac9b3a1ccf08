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

This module holds the trainer and the policy's passes; the rest is in modules of its own:
`build` (loading and sharding a model), `reference` (the KL reference's two modes), `critic`
(the value model's passes), `step` (what the policy and critic steps share), `replay` (MoE
routing replay), `fsdp_checkpoint` (save and load) and `sleep` (offload while the rollout runs).

Weight sync (the plan, the broadcast or in-place transfer, the checksum) is `WeightSender`'s, over
this trainer's full tensors under their Hugging Face names.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from miles.core.contracts.backends import BucketDelivery, LogprobResult, TrainSetup
from miles.core.contracts.protocols import PolicyLoss
from miles.core.contracts.types import PackedBatch
from miles.core.contracts.weight_sync import SyncPlan
from miles.precision.lora import merge_named
from miles.torch.sync.sender import WeightSender, WeightView
from miles.torch.train import checkpoint as ckpt
from miles.torch.train import packed_attention, profiling, reference
from miles.torch.train.build import build_model
from miles.torch.train.checks import family_of_checkpoint, packs_sequences
from miles.torch.train.config import FSDPConfig, schedule_problem
from miles.torch.train.critic import CRITIC_DIR, critic_values, value_step
from miles.torch.train.distributed import init_process_group, resolve_device
from miles.torch.train.fsdp_checkpoint import (
    Trained,
    load_rng,
    load_trained,
    read_state,
    save_checkpoint,
)
from miles.torch.train.logprobs import token_logprobs
from miles.torch.train.microbatch import (
    MicroBatch,
    batch_loss_weights,
    loss_inputs,
    shard_micro_batches,
)
from miles.torch.train.optim import build_optimizer, lr_at
from miles.torch.train.replay import replaying, routing_metrics, routing_replay
from miles.torch.train.sleep import to_device, to_host
from miles.torch.train.step import MetricSums, optimizer_step
from miles.torch.weights import named_state

_TRAINER_METRICS = ("train/loss", "train/entropy", "train/grad_norm", "train/lr")


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
        # The KL reference (see `reference`): a frozen model, or host shards of the policy's.
        self.ref_model: Any = None
        self._ref_shards: list[torch.Tensor] | None = None
        if setup.reference and cfg.ref_mode == "copy":
            self.ref_model = self._build_model(model_path, trainable=False)[0]
        elif setup.reference:  # "offload": this rank's shards of the initial weights, on the host
            self._ref_shards = reference.host_shards(self.model)
        self.optimizer = build_optimizer(self.model.parameters(), cfg)
        self.replay = routing_replay(self.model, setup.routing_replay)
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
        """The sharded model and its decoder layers' name prefixes (see `build.build_model`)."""
        return build_model(
            path,
            self.cfg,
            self.setup,
            self.mesh,
            attn=self._attention(),
            compiled=self._compiles(),
            rms_norms=self._rms_norms,
            device=self.device,
            trainable=trainable,
            critic=critic,
            seed=seed,
        )

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

    def _models(self) -> list[Any]:
        models = [self.model]
        if self.ref_model is not None:
            models.append(self.ref_model)
        if self.critic is not None:
            models.append(self.critic)
        return models

    def _trained(self) -> list[Trained]:
        """Each trained model with its optimizer, as a checkpoint holds them."""
        out = [
            Trained(
                self.model,
                self.optimizer,
                self._layer_prefixes,
                Path("."),
                adapters_only=self.lora is not None,
            )
        ]
        if self.critic is not None:
            assert self.critic_optimizer is not None
            out.append(
                Trained(
                    self.critic,
                    self.critic_optimizer,
                    self._critic_layer_prefixes,
                    Path(CRITIC_DIR),
                    critic=True,
                )
            )
        return out

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
            with replaying(self.replay, mb, count=not mb.is_padding):
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
            # "offload": a second pass of the policy model, with the reference's weights in it
            with reference.swapped_in(self.model, self._ref_shards, self.device):
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
            metrics=routing_metrics(self.replay, self.world_size, self.device),
        )

    @torch.no_grad()
    def values(self, batch: PackedBatch) -> npt.NDArray[np.float32]:
        """The critic's values, fp32 aligned with batch.tokens: values[t] is the critic's output
        at position t - 1 (the state before token t), 0 at every sequence's first token.

        Collective like `logprobs`: every rank passes the whole batch and gets the whole result.
        """
        critic = self._require_critic()
        return critic_values(
            critic, self._micro_batches(batch), len(batch.tokens), self.device, self.world_size
        )

    # -- train steps ------------------------------------------------------------------------

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
        sums = MetricSums()  # loss-weighted sums, this rank's share
        self.weights.weights_changed()
        self.optimizer.zero_grad(set_to_none=True)
        for mb in self._micro_batches(batch):
            # Replay stays on through backward: recomputed layers route the same way.
            with replaying(self.replay, mb):
                lp, entropy = token_logprobs(self.model, mb, self.temperature)
                inputs = loss_inputs(batch, weights, mb, lp, entropy, self.device)
                per_token, metrics = loss(inputs)
                (per_token * inputs.loss_weights).sum().backward()
            sums.add("train/loss", per_token, inputs.loss_weights)
            sums.add("train/entropy", entropy, inputs.loss_weights)
            for key, value in metrics.items():
                key = key if key.startswith("train/") else f"train/{key}"
                if key in _TRAINER_METRICS:
                    raise ValueError(f"loss metric {key!r} clashes with the trainer's own")
                sums.add(key, value, inputs.loss_weights)

        out = sums.reduce(weights, "train/loss", self.world_size)
        lr = lr_at(self.cfg, self.step)
        grad_norm = optimizer_step(self._trainable(), self.optimizer, lr, self.cfg.grad_clip)
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
        out = value_step(
            critic,
            self.critic_optimizer,
            batch,
            loss,
            self._micro_batches(batch),
            lr=lr_at(self.cfg, self.critic_step, self.critic_lr),
            grad_clip=self.cfg.grad_clip,
            device=self.device,
            world_size=self.world_size,
        )
        if math.isfinite(out["critic/grad_norm"]):
            self.critic_step += 1
        return out

    def _micro_batches(self, batch: PackedBatch) -> list[MicroBatch]:
        return shard_micro_batches(
            batch,
            self.cfg.micro_batch_tokens,
            self.rank,
            self.world_size,
            self.device,
            packed=self.packed,
        )

    # -- weights ----------------------------------------------------------------------------

    @torch.no_grad()
    def named_weights(self, view: WeightView = "sync") -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter and persistent buffer, fp32, on this device.

        Names are the unwrapped Hugging Face model's `state_dict()` names; tied weights appear
        once (under the first name, e.g. model.embed_tokens.weight). With LoRA, view "sync" is
        what `lora.sync` says (base + adapters under the base names, or the adapters alone),
        "merged" base + adapters, "base" the frozen base alone. Collective: every rank must
        iterate to the end, since each tensor is all-gathered.
        """
        full = ((name, ckpt.full_tensor(t)) for name, t in named_state(self.model))
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

    # -- checkpoints (see `fsdp_checkpoint`) ------------------------------------------------

    def save(self, path: str) -> None:
        """Write a checkpoint directory (see `checkpoint`): weights, optimizer, RNG, step; and
        the critic's weights and optimizer under `critic/` (a Hugging Face token-classification
        checkpoint of its own)."""
        state: dict[str, Any] = {
            "step": self.step,
            "world_size": self.world_size,
            "config": dataclasses.asdict(self.cfg),
        }
        if self.critic is not None:
            state["critic_step"] = self.critic_step
        save_checkpoint(
            path,
            self._trained(),
            state,
            rank=self.rank,
            device=self.device,
            model_path=self.model_path,
            generation_config=self.model.generation_config,
        )

    @torch.no_grad()
    def load(self, path: str) -> None:
        """Restore a `save`d checkpoint: weights, optimizer state, step, (same world size) RNG,
        and the critic's weights, optimizer state and step when this trainer has a critic. The
        config is this trainer's own; the reference model stays the one at model_path.
        """
        self.weights.weights_changed()
        state = read_state(path, has_critic=self.critic is not None)
        load_trained(Path(path), self._trained(), self._attention())
        self.step = int(state["step"])
        self.critic_step = int(state.get("critic_step", 0))
        if state["world_size"] == self.world_size:
            load_rng(Path(path), self.rank, self.device)

    # -- memory -----------------------------------------------------------------------------

    def sleep(self) -> None:
        """Move weights and optimizer state to CPU, freeing GPU memory for the rollout engine.

        On a CPU trainer there is nothing to free: a no-op.
        """
        to_host(self._models(), [t.optimizer for t in self._trained()], self.device)

    def wake(self) -> None:
        """Undo `sleep`. A no-op on a CPU trainer."""
        to_device(self._models(), [t.optimizer for t in self._trained()], self.device)

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
