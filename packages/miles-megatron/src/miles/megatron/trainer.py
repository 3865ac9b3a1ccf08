"""`megatron`: the Megatron-core train backend, one `MegatronTrainer` per rank.

The model is megatron-core's `GPTModel` on the local layer spec (`miles.megatron.model`), filled
from the Hugging Face checkpoint by the family's mapping (`convert.shard`), and trained by
megatron-core's own machinery: `DistributedDataParallel`, `get_megatron_optimizer` (Adam, fp32
main weights, the distributed optimizer on CUDA), `OptimizerParamScheduler`,
`get_forward_backward_func` (1F1B at PP > 1) and `finalize_model_grads`, and `RouterReplay`
for MoE routing replay.

Data parallelism: every rank is handed the whole batch. Its micro-batches (packed THD rows of at
most `micro_batch_tokens` real tokens) are shared over the data-parallel ranks as the fsdp
backend shares them over its ranks, padding micro-batches included, so every rank of a tensor,
pipeline or expert group runs the same number of passes. The loss is a sum
(`calculate_per_token_loss`, and no division by tokens in `finalize_model_grads`): `loss_weights`
already fold the aggregation over the global batch, so summed gradients are exactly those of the
one-shot global loss, as with fsdp.

Logprobs and entropy come from the last pipeline stage's hidden states through the
vocabulary-parallel head (`miles.megatron.head`); each token is filled in by one data-parallel
rank's last stage, and one all-reduce gives every rank the whole arrays.

Checkpoints are safetensors and JSON, like fsdp's and with the same files: the fp32 main weights
as a Hugging Face checkpoint and Adam's moments under Hugging Face names, gathered from the
shards. They hold no layout: a checkpoint resumes at any TP / PP / EP / DP.

This module is the trainer's protocol; its parts live beside it: `build` (parallel state, model,
optimizer, LR schedule), `forward` (a stage's forward and the pipeline schedule), `train_step`
(the loss, metrics and optimizer step), `reference` (the KL reference weights), `checkpoint`,
`replay` (MoE routing replay) and `offload` (sleep / wake).
"""

from __future__ import annotations

import dataclasses
import gc
import math
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay
from miles.core.contracts.backends import BucketDelivery, LogprobResult, TrainSetup
from miles.core.contracts.family import MegatronMapping
from miles.core.contracts.protocols import PolicyLoss
from miles.core.contracts.types import PackedBatch
from miles.core.contracts.weight_sync import SyncPlan
from miles.megatron.build import (
    build_model_and_optimizer,
    default_dtype,
    init_model_parallel,
    keep_padding_row,
    local_params,
    lr_scheduler,
)
from miles.megatron.checkpoint import (
    load_rng,
    load_weights,
    moment_sources,
    read_trainer_state,
    save_checkpoint,
)
from miles.megatron.config import MegatronConfig, schedule_problem
from miles.megatron.convert import TensorSource, WeightSource
from miles.megatron.forward import LossOf, StageForward, run_schedule
from miles.megatron.gathering import ShardGather, exchange_rank_info
from miles.megatron.layout import ParallelLayout
from miles.megatron.offload import HostOffload, device_tensors, grad_buffers
from miles.megatron.reference import ReferenceWeights
from miles.megatron.replay import routing_metrics, stage_routing_replay
from miles.megatron.sources import checkpoint_source, megatron_mapping
from miles.megatron.train_step import MicroBatchLoss, optimizer_step, reduce_metrics
from miles.torch.models import local_checkpoint
from miles.torch.sync.sender import WeightSender, WeightView
from miles.torch.train import profiling
from miles.torch.train.distributed import init_process_group, resolve_device
from miles.torch.train.microbatch import MicroBatch, batch_loss_weights, shard_micro_batches


class MegatronTrainer:
    """One rank of a Megatron-core training group over a family's GPTModel.

    All methods except `sleep`/`wake` are collective: every rank calls them in the same order
    with the same arguments. Dropout is off, so a train step's logprobs equal `logprobs`'.
    """

    def __init__(self, cfg: MegatronConfig, setup: TrainSetup) -> None:
        total_steps = cfg.total_steps or setup.total_steps
        if problem := schedule_problem(cfg, total_steps):
            raise ValueError(problem)
        self.cfg = dataclasses.replace(cfg, total_steps=total_steps)
        # A .gguf model is read through the checkpoint Miles converts it to, as fsdp reads it.
        self.setup, self.model_path = setup, local_checkpoint(setup.model_path)
        self.rank, self.world_size = setup.rank, setup.world_size
        self.temperature = setup.temperature
        self.device = resolve_device(setup.device)
        if self.device.type == "cpu":
            if not cfg.cpu_test_shims:
                raise RuntimeError(
                    "the megatron backend runs on CUDA GPUs; on CPU ranks only for tests, with "
                    "train.cpu_test_shims: true (or use train.backend: fsdp)"
                )
            if setup.cpu_threads:
                torch.set_num_threads(setup.cpu_threads)
        self._owns_process_group = init_process_group(
            self.device, setup.master_addr, setup.master_port, self.rank, self.world_size
        )
        torch.manual_seed(setup.seed)
        self.dtype = getattr(torch, self.cfg.dtype or default_dtype(setup, self.device))
        p = setup.parallel
        self.layout = ParallelLayout(
            tp=p.tensor, pp=p.pipeline, ep=p.expert, etp=self.cfg.expert_tensor_parallel
        )
        self.coords = init_model_parallel(self.layout, self.device, setup.seed)
        self.mapping: MegatronMapping = megatron_mapping(self.model_path)
        self.vocab_size = int(self.mapping.model["vocab_size"])
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.ddp, self.optimizer = build_model_and_optimizer(
            self.cfg, self.mapping, self.layout, self.dtype, self.device
        )
        keep_padding_row(self.ddp.module, self.model_path, self.coords.tp)
        self.scheduler = lr_scheduler(self.optimizer, self.cfg)
        self._names = {id(p): n for n, p in self.ddp.module.named_parameters()}
        ranks = exchange_rank_info(self.coords, self._local_params())
        self.gathering = ShardGather(self.mapping, self.layout, ranks, self.rank, self.device)
        self.replay = stage_routing_replay(
            setup.routing_replay, self.mapping, self.layout, self.coords.pp
        )
        self._forward = StageForward(
            self.last_stage, self.coords.tp, self.vocab_size, self.temperature, self.replay
        )
        self.step = 0  # optimizer steps taken
        self._load_weights(checkpoint_source(self.model_path, self.mapping))
        # The reference policy (a KL term): this rank's initial weights in host memory.
        self._reference: ReferenceWeights | None = None
        if setup.reference:
            self._reference = ReferenceWeights(self.ddp.module.parameters())
        self.weights = WeightSender(self.named_weights, setup, self.device)
        self._offload = HostOffload()
        self._closed = False

    def _local_params(self) -> dict[str, torch.Tensor]:
        return local_params(self.ddp)

    def _load_weights(
        self, source: WeightSource, state: Mapping[str, WeightSource] | None = None
    ) -> None:
        """The model's weights and fp32 main weights from `source`, Adam's moments from `state`
        (None: a fresh optimizer)."""
        load_weights(
            self._local_params(),
            self.optimizer,
            source,
            self.mapping,
            self.layout,
            self.coords,
            state,
            self.step,
        )

    # -- forward and backward --------------------------------------------------------------------

    def _micro_batches(self, batch: PackedBatch) -> list[MicroBatch]:
        return shard_micro_batches(
            batch,
            self.cfg.micro_batch_tokens,
            self.dp_rank,
            self.dp_size,
            self.device,
            packed=True,
        )

    def _schedule(
        self, mbs: list[MicroBatch], loss_of: LossOf, forward_only: bool
    ) -> list[dict[str, Any]]:
        return run_schedule(self.ddp, self._forward, mbs, loss_of, forward_only)

    @torch.no_grad()
    def logprobs(self, batch: PackedBatch) -> LogprobResult:
        """Logprobs, entropy (and reference logprobs): fp32 arrays aligned with batch.tokens,
        0 at every sequence's first token. Every rank passes the whole batch and gets the whole
        result."""
        has_ref = self._reference is not None
        out = torch.zeros(3 if has_ref else 2, len(batch.tokens), device=self.device)
        mbs = self._micro_batches(batch)

        def fill(
            rows: slice, mb: MicroBatch, result: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            """Writes (logprobs, entropy) of `mb` into `rows` of `out` (the reference: one)."""
            if not mb.is_padding and self.coords.tp == 0:  # tensor ranks hold the same values
                n = rows.stop - rows.start
                out[rows, torch.from_numpy(mb.token_index).to(self.device)] = result[:n]
            return result.sum() * 0.0, {}

        self.ddp.eval()
        if self.replay is not None:
            self.replay.counting = True
        try:
            self._schedule(mbs, partial(fill, slice(0, 2)), forward_only=True)
        finally:
            if self.replay is not None:
                self.replay.counting = False
        if self._reference is not None:
            params = list(self.ddp.module.parameters())
            with self._reference.swapped_in(params, self.device):
                self._schedule(mbs, partial(fill, slice(2, 3)), forward_only=True)
        if self.world_size > 1:
            dist.all_reduce(out)  # each token was filled in by exactly one rank, 0 elsewhere
        arrays = out.cpu().numpy()
        return LogprobResult(
            logprobs=arrays[0],
            entropy=arrays[1],
            ref_logprobs=arrays[2] if has_ref else None,
            metrics=routing_metrics(self.replay, self.coords.tp, self.world_size, self.device),
        )

    def train_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]:
        """One optimizer step on the whole batch; every rank returns the same metrics.

        As fsdp's: reads `batch.loss_weights` (default: token mean over `loss_mask`),
        `batch.old_logprobs` (default: the current logprobs, detached) and `batch.ref_logprobs`.
        Metrics: "train/loss", "train/entropy" and the loss's metrics as loss-weighted means,
        "train/grad_norm" (before clipping) and "train/lr". A non-finite grad norm skips the
        update.
        """
        weights = batch_loss_weights(batch)
        loss_of = MicroBatchLoss(batch, weights, loss, self.device)
        self.weights.weights_changed()
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._schedule(self._micro_batches(batch), loss_of, forward_only=False)
        out = reduce_metrics(
            reports,
            loss_of.keys,
            weights,
            tp_rank=self.coords.tp,
            world_size=self.world_size,
            device=self.device,
        )
        lr = float(self.optimizer.param_groups[0]["lr"])  # set by the scheduler
        grad_norm = optimizer_step(self.ddp, self.optimizer, self.cfg.grad_clip)
        if math.isfinite(grad_norm):
            self.step += 1
            self.scheduler.step(increment=1)
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out

    # -- weights and checkpoints -------------------------------------------------------------

    @torch.no_grad()
    def named_weights(self, view: WeightView = "sync") -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, whole tensor) of every weight, gathered from the shards unit by
        unit, on every rank (collective). The model's weights, in its dtype. No LoRA here: every
        view is the weights."""
        params = self._local_params()
        return self.gathering.named(lambda name: params[name])

    def weight_sync_plan(self, bucket_bytes: int) -> SyncPlan:
        return self.weights.plan(bucket_bytes)

    def join_weight_sync(self, host: str, port: int, world_size: int) -> None:
        self.weights.join(host, port, world_size)

    def leave_weight_sync(self) -> None:
        self.weights.close()

    def send_weights(self, plan: SyncPlan) -> int:
        return self.weights.send(plan)

    def send_weights_in_place(self, plan: SyncPlan, deliver: BucketDelivery | None) -> int:
        return self.weights.send_in_place(plan, deliver)

    def weights_checksum(self, dtype: str | None) -> str:
        return self.weights.checksum(dtype)

    def profiled(self, path: str) -> AbstractContextManager[None]:
        return profiling.profiled(path, self.device)

    def save(self, path: str) -> None:
        """A checkpoint directory with fsdp's files: `model.safetensors` (the fp32 main weights,
        a Hugging Face checkpoint), `optimizer.safetensors` ("<name>/exp_avg", ...,
        "<name>/step"), config.json and the tokenizer's files, each rank's RNG state and
        `trainer_state.json` (the step, which is the LR schedule's whole state)."""
        save_checkpoint(
            path,
            optimizer=self.optimizer,
            params=self._local_params(),
            gathering=self.gathering,
            model_path=self.model_path,
            cfg=self.cfg,
            step=self.step,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
        )

    @torch.no_grad()
    def load(self, path: str) -> None:
        """Restores a `save`d checkpoint (of any layout): weights, fp32 main weights,
        Adam's moments and step (so the LR schedule), and (same world size) each rank's RNG."""
        self.weights.weights_changed()
        state = read_trainer_state(path)
        self.step = int(state["step"])
        weights = checkpoint_source(str(Path(path)), self.mapping)
        self._load_weights(weights, moment_sources(path, weights))
        # The schedule is a function of the step count (this run's config, as with fsdp).
        self.scheduler = lr_scheduler(self.optimizer, self.cfg)
        if self.step:
            self.scheduler.step(increment=self.step)
        if state["world_size"] == self.world_size:
            load_rng(path, self.rank, self.device)

    # -- memory ----------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Weights, gradient buffers and optimizer state to pinned host memory, freeing the GPU
        for a colocated engine. A no-op on CPU ranks."""
        if self.device.type != "cuda":
            return
        grads = grad_buffers(self.ddp)
        self._offload.offload(device_tensors(self.ddp, self.optimizer), discard=grads)

    def wake(self) -> None:
        if self.device.type == "cuda":
            self._offload.restore()

    def close(self) -> None:
        """Frees the model and optimizer, and the process group if this trainer made it."""
        if self._closed:
            return
        self._closed = True
        self.weights.close()
        if dist.is_initialized():
            dist.barrier()
        RouterReplay.clear_global_router_replay_instances()
        del self.optimizer, self.ddp, self.scheduler, self.weights
        gc.collect()
        parallel_state.destroy_model_parallel()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


__all__ = ["MegatronTrainer", "TensorSource"]
