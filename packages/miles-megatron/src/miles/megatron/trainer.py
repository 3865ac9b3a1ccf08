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
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.moe.router_replay import RouterReplay
from miles.core.backends import BucketDelivery, LogprobResult, TrainSetup
from miles.core.family import MegatronMapping
from miles.core.protocols import LossInputs, PolicyLoss
from miles.core.types import PackedBatch
from miles.core.weight_sync import SyncPlan
from miles.megatron.config import MegatronConfig, schedule_problem
from miles.megatron.convert import TensorSource, WeightSource, shard
from miles.megatron.cpu_shims import run_megatron_on_cpu
from miles.megatron.gathering import ShardGather, exchange_rank_info
from miles.megatron.head import bypass_output_layer, output_weight
from miles.megatron.layout import ParallelLayout, Rank
from miles.megatron.logprobs import vocab_parallel_logprobs
from miles.megatron.model import build_gpt_model, transformer_config
from miles.megatron.offload import HostOffload
from miles.megatron.optimizer_state import MOMENTS, gather_state, load_state, optimizers
from miles.megatron.replay import RoutingReplay
from miles.megatron.sources import checkpoint_source, megatron_mapping
from miles.torch.models import local_checkpoint
from miles.torch.sync.sender import WeightSender, WeightView
from miles.torch.train import checkpoint as ckpt
from miles.torch.train import profiling
from miles.torch.train.distributed import init_process_group, resolve_device
from miles.torch.train.layers import compile_layer
from miles.torch.train.microbatch import (
    MicroBatch,
    batch_loss_weights,
    loss_inputs,
    per_token,
    shard_micro_batches,
)
from miles.torch.train.rms_norm import fuse_torch_rms_norms

CHECKPOINT_FORMAT = 1
BACKEND = "megatron"
_TRAINER_METRICS = ("train/loss", "train/entropy", "train/grad_norm", "train/lr")


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
        self.dtype = getattr(torch, self.cfg.dtype or _default_dtype(setup, self.device))
        p = setup.parallel
        self.layout = ParallelLayout(
            tp=p.tensor, pp=p.pipeline, ep=p.expert, etp=self.cfg.expert_tensor_parallel
        )
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.layout.tp,
            pipeline_model_parallel_size=self.layout.pp,
            expert_model_parallel_size=self.layout.ep,
            expert_tensor_parallel_size=self.layout.expert_tp,
        )
        if self.device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(setup.seed)
        else:
            run_megatron_on_cpu()
        self.mapping: MegatronMapping = megatron_mapping(self.model_path)
        self.vocab_size = int(self.mapping.model["vocab_size"])
        self.coords = Rank(
            pp=parallel_state.get_pipeline_model_parallel_rank(),
            tp=parallel_state.get_tensor_model_parallel_rank(),
            ep=parallel_state.get_expert_model_parallel_rank(),
            etp=parallel_state.get_expert_tensor_parallel_rank(),
        )
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.ddp, self.optimizer = self._build()
        self._keep_padding_row(self.model_path)
        self.scheduler = self._scheduler()
        self._names = {id(p): n for n, p in self.ddp.module.named_parameters()}
        ranks = exchange_rank_info(self.coords, self._local_params())
        self.gathering = ShardGather(self.mapping, self.layout, ranks, self.rank, self.device)
        self.replay = self._routing_replay()
        self._load_weights(checkpoint_source(self.model_path, self.mapping))
        # The reference policy (a KL term): this rank's initial weights in host memory, swapped
        # into the model for the reference forward.
        self._reference: list[torch.Tensor] | None = None
        if setup.reference:
            self._reference = [_host_copy(p) for p in self.ddp.module.parameters()]
        self.step = 0  # optimizer steps taken
        self.weights = WeightSender(self.named_weights, setup, self.device)
        self._offload = HostOffload()
        self._closed = False

    # -- model -----------------------------------------------------------------------------------

    def _build(self) -> tuple[Any, Any]:
        cfg = self.cfg
        recompute: dict[str, Any] = {}
        if cfg.activation_checkpointing:
            recompute = dict(
                recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            )
        RouterReplay.clear_global_router_replay_instances()  # a class-level list per process
        moe = bool(self.mapping.transformer.get("num_moe_experts"))
        dense_pipeline = {"moe_token_dispatcher_type": "alltoall"} if not moe else {}
        config = transformer_config(
            self.mapping,
            self.layout,
            self.dtype,
            # alltoall makes CUDA streams at construction; the CPU shims run allgather (which
            # megatron-core refuses with a pipeline: MoE at PP > 1 runs on GPUs only).
            token_dispatcher="alltoall" if self.device.type == "cuda" else "allgather",
            calculate_per_token_loss=True,
            # Packed micro-batches differ in length: pipeline messages say their shapes.
            variable_seq_lengths=self.layout.pp > 1,
            # The routers' RouterReplay: replays records, or only compares with them ("off").
            moe_enable_routing_replay=True,
            **(dense_pipeline if self.layout.pp > 1 else {}),
            **recompute,
        )
        module = build_gpt_model(self.mapping, self.layout, config)
        bypass_output_layer(module)
        if self._compiles(moe):
            for layer in module.decoder.layers:  # only the forward: names and hooks stay
                compile_layer(layer, fallback=cfg.compile == "auto")
        else:
            # Eager torch RMSNorm is several elementwise kernels each way (65 ms of a W0 step on
            # an H100, docs/benchmarks.md); on CUDA the norms run Miles' fused kernels instead.
            fuse_torch_rms_norms(module, self.device)
        distributed = cfg.distributed_optimizer and self.device.type == "cuda"
        ddp = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=distributed
            ),
            module,
        )
        # Gradients are summed, never divided by a token count (see the module docstring).
        config.finalize_model_grads_func = _finalize_summed
        config.grad_scale_func = None
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=cfg.lr,
                min_lr=cfg.lr * cfg.min_lr_ratio,
                weight_decay=cfg.weight_decay,
                adam_beta1=cfg.betas[0],
                adam_beta2=cfg.betas[1],
                adam_eps=cfg.eps,
                bf16=self.dtype == torch.bfloat16,
                params_dtype=self.dtype,
                use_distributed_optimizer=distributed,
                clip_grad=0.0,  # clipped here, after the non-finite check (`_optimizer_step`)
            ),
            [ddp],
        )
        return ddp, optimizer

    def _compiles(self, moe: bool) -> bool:
        """MoE layers stay eager under "auto": their token dispatch syncs with the host and
        their routers keep replay state, which would break the graph at every layer."""
        return self.cfg.compile == "on" or (
            self.cfg.compile == "auto" and self.device.type == "cuda" and not moe
        )

    def _keep_padding_row(self, model_path: str) -> None:
        """transformers' embeddings hold their padding token's row fixed (`padding_idx`: no
        gradient ever reaches it); megatron-core's have no such row, so its gradient is zeroed
        here. It matters: a padding token in a sequence embeds to zeros, whose norm's gradient
        is huge."""
        from miles.core.families import read_config
        from miles.core.family import text_config

        config = read_config(model_path) or {}
        pad = text_config(config).get("pad_token_id")
        if not isinstance(pad, int) or not parallel_state.is_pipeline_first_stage():
            return
        weight = self.ddp.module.embedding.word_embeddings.weight
        row = pad - self.coords.tp * weight.shape[0]
        if 0 <= row < weight.shape[0]:
            weight.register_hook(
                lambda grad: grad.index_fill(0, torch.tensor([row]).to(grad.device), 0.0)
            )

    def _scheduler(self) -> OptimizerParamScheduler:
        cfg = self.cfg
        decay_steps = max(cfg.total_steps, cfg.warmup_steps + 1)
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=cfg.lr,
            min_lr=cfg.lr * cfg.min_lr_ratio,
            lr_warmup_steps=cfg.warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=cfg.lr_schedule,
            start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
        )

    def _routing_replay(self) -> RoutingReplay | None:
        if not RouterReplay.global_router_replay_instances:
            return None
        moe_layers = sorted(
            {layer for w in self.mapping.weights if w.megatron.endswith("mlp.router.weight")
             for layer in w.layers}
        )  # fmt: skip
        stage = self.layout.stage_layers(
            int(self.mapping.transformer["num_layers"]), self.coords.pp
        )
        columns = [i for i, layer in enumerate(moe_layers) if layer in stage]
        return RoutingReplay(self.setup.routing_replay, columns)

    def _local_params(self) -> dict[str, torch.Tensor]:
        return {
            k: v
            for k, v in self.ddp.module.state_dict(keep_vars=True).items()
            if not k.endswith("_extra_state")
        }

    @torch.no_grad()
    def _load_weights(
        self, source: WeightSource, state: Mapping[str, WeightSource] | None = None
    ) -> None:
        """The model's weights and the optimizer's fp32 main weights from Hugging Face weights
        (no rounding through bf16), and Adam's moments from `state` (None: zeros)."""
        mine = shard(source, self.mapping, self.layout, self.coords)
        moments = {
            key: shard(src, self.mapping, self.layout, self.coords)
            for key, src in (state or {}).items()
        }
        params = self._local_params()
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
        load_state(self.optimizer, whole, self.step if state else 0)
        if not state:  # a fresh optimizer: no moments, no steps yet
            for opt_state in _adam_states(self.optimizer):
                opt_state.clear()

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

    def _forward(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """[2, mb.num_tokens] (logprobs, entropy) on the last stage; hidden states elsewhere."""
        assert mb.cu_seq_lens is not None and mb.position_ids is not None
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seq_lens,
            cu_seqlens_kv=mb.cu_seq_lens,
            max_seqlen_q=mb.max_seq_len,
            max_seqlen_kv=mb.max_seq_len,
        )
        if self.replay is not None:
            self.replay.set_record(mb.routing)
        out: torch.Tensor = model(mb.input_ids, mb.position_ids, None, packed_seq_params=packed)
        if not self.last_stage:
            return out
        hidden = out.reshape(-1, out.shape[-1])
        weight = output_weight(model.module)
        targets = mb.input_ids[0, mb.target_pos]
        lp, entropy = vocab_parallel_logprobs(
            hidden[mb.target_pos - 1],
            weight,
            targets,
            vocab_start=self.coords.tp * weight.shape[0],
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        zeros = torch.zeros(mb.num_tokens, 2, dtype=torch.float32, device=lp.device)
        return zeros.index_put((mb.target_pos,), torch.stack([lp, entropy], dim=1)).t()

    def _schedule(
        self,
        mbs: list[MicroBatch],
        loss_of: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
        forward_only: bool,
    ) -> list[dict[str, Any]]:
        """Runs the micro-batches through megatron-core's schedule; what `loss_of` reported for
        each, on the last stage (an empty list elsewhere)."""

        def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
            mb = next(data)
            return self._forward(model, mb), partial(_loss_func, loss_of, mb)

        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mbs),
            model=[self.ddp],
            num_microbatches=len(mbs),
            seq_length=max(mb.num_tokens for mb in mbs),
            micro_batch_size=1,
            forward_only=forward_only,
        )
        return list(out) if out else []

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
        if has_ref:
            with self._reference_weights():
                self._schedule(mbs, partial(fill, slice(2, 3)), forward_only=True)
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
        """The initial weights in the model while inside; the policy's afterwards."""
        assert self._reference is not None
        params = list(self.ddp.module.parameters())
        saved = [_host_copy(p) for p in params]
        try:
            with torch.no_grad():
                for p, ref in zip(params, self._reference, strict=True):
                    p.copy_(ref, non_blocking=True)
            yield
        finally:
            with torch.no_grad():
                for p, policy in zip(params, saved, strict=True):
                    p.copy_(policy, non_blocking=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def train_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]:
        """One optimizer step on the whole batch; every rank returns the same metrics.

        As fsdp's: reads `batch.loss_weights` (default: token mean over `loss_mask`),
        `batch.old_logprobs` (default: the current logprobs, detached) and `batch.ref_logprobs`.
        Metrics: "train/loss", "train/entropy" and the loss's metrics as loss-weighted means,
        "train/grad_norm" (before clipping) and "train/lr". A non-finite grad norm skips the
        update.
        """
        weights = batch_loss_weights(batch)
        keys: list[str] = []

        def loss_of(mb: MicroBatch, result: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            lp, entropy = result[0], result[1]
            inputs = self._loss_inputs(batch, weights, mb, lp, entropy)
            per_token, metrics = loss(inputs)
            w = inputs.loss_weights
            sums = {"train/loss": per_token, "train/entropy": entropy}
            for key, value in metrics.items():
                key = key if key.startswith("train/") else f"train/{key}"
                if key in _TRAINER_METRICS:
                    raise ValueError(f"loss metric {key!r} clashes with the trainer's own")
                sums[key] = value
            if not keys:
                keys.extend(sorted(sums))
            reported = torch.stack([(sums[k].detach().float() * w).sum() for k in keys])
            return (per_token * w).sum(), {"sums": reported}

        self.weights.weights_changed()
        self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = self._schedule(self._micro_batches(batch), loss_of, forward_only=False)
        out = self._reduce_metrics(reports, keys, weights)
        lr = float(self.optimizer.param_groups[0]["lr"])  # set by the scheduler
        grad_norm = self._optimizer_step()
        if math.isfinite(grad_norm):
            self.step += 1
            self.scheduler.step(increment=1)
        out["train/grad_norm"] = grad_norm
        out["train/lr"] = lr
        return out

    def _reduce_metrics(
        self, reports: list[dict[str, Any]], keys: list[str], weights: npt.NDArray[np.float32]
    ) -> dict[str, float]:
        """Loss-weighted sums from tensor rank 0 of each data-parallel rank's last stage, summed
        over the world; every metric but the loss becomes a loss-weighted mean. Only last-stage
        ranks know the loss's metric names: they travel too."""
        if self.world_size > 1:
            everyone: list[list[str] | None] = [None] * self.world_size
            dist.all_gather_object(everyone, keys)
            keys = next((k for k in everyone if k), [])
        totals = torch.zeros(len(keys), dtype=torch.float32, device=self.device)
        if self.coords.tp == 0:
            for r in reports:
                totals += r["sums"].to(self.device)
        if self.world_size > 1:
            dist.all_reduce(totals)
        total_weight = float(np.sum(weights, dtype=np.float64)) or 1.0
        return {
            k: float(v) / (1.0 if k == "train/loss" else total_weight)
            for k, v in zip(keys, totals.tolist(), strict=True)
        }

    def _optimizer_step(self) -> float:
        """The grad norm (before clipping); clips and steps only when it is finite."""
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        if math.isfinite(grad_norm):
            clip = self.cfg.grad_clip
            if clip > 0 and grad_norm > clip:  # megatron-core's factor, from the norm in hand
                coeff = clip / (grad_norm + 1.0e-6)
                grads = [p.grad for opt in optimizers(self.optimizer) for p in opt.get_parameters()]
                torch._foreach_mul_([g for g in grads if g is not None], coeff)
            self.optimizer.step_with_ready_grads()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        return grad_norm

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

    def _routing_metrics(self) -> dict[str, float]:
        if self.replay is None:
            return {}
        s = self.replay.take_stats()
        counts = torch.tensor(
            [s.compared, s.agreed, s.replayed, s.matched], dtype=torch.float64, device=self.device
        )
        # Tensor ranks route the same tokens: count the first's; data ranks and stages add up.
        counts *= float(self.coords.tp == 0)
        if self.world_size > 1:
            dist.all_reduce(counts)
        compared, agreed, replayed, matched = counts.tolist()
        if not compared:
            return {}
        metrics = {"moe/routing_agreement": agreed / compared, "moe/replayed_tokens": replayed}
        if self.replay.mode != "off":
            metrics["moe/replayed_match"] = matched / compared
        return metrics

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
        state = gather_state(self.optimizer)
        params = self._local_params()

        def local(key: str) -> Callable[[str], torch.Tensor]:
            def get(name: str) -> torch.Tensor:
                param = params[name]
                entry = state.get(id(param))
                if entry is None:  # a buffer (e.g. a router's expert bias): no optimizer state
                    return param.float() if key == "main" else torch.zeros_like(param.float())
                return entry[key]

            return get

        with ckpt.atomic_directory(path, self.rank) as tmp:
            weights = {n: t.cpu() for n, t in self.gathering.named(local("main"), torch.float32)}
            optim: dict[str, torch.Tensor] = {}
            for key in MOMENTS:
                for name, t in self.gathering.named(local(key), torch.float32):
                    optim[f"{name}/{key}"] = t.cpu()
            for name in weights:
                optim[f"{name}/step"] = torch.tensor(float(self.step))
            if self.rank == 0:
                skeleton = _causal_lm_skeleton(self.model_path)
                on_disk = _on_disk(skeleton, weights)
                save_file(on_disk, tmp / ckpt.MODEL_FILE, metadata={"format": "pt"})
                save_file(optim, tmp / ckpt.OPTIMIZER_FILE)
                skeleton.config.save_pretrained(tmp)  # the trained model's, as fsdp writes it
                generation = Path(self.model_path) / "generation_config.json"
                if generation.is_file():
                    (tmp / generation.name).write_bytes(generation.read_bytes())
                ckpt.copy_tokenizer_files(self.model_path, tmp)
                ckpt.write_json(
                    tmp / ckpt.STATE_FILE,
                    {
                        "format": CHECKPOINT_FORMAT,
                        "backend": BACKEND,
                        "step": self.step,
                        "world_size": self.world_size,
                        "config": dataclasses.asdict(self.cfg),
                    },
                )
            rng = {"cpu": torch.get_rng_state()}
            if self.device.type == "cuda":
                rng["cuda"] = torch.cuda.get_rng_state(self.device)
            save_file(rng, tmp / ckpt.rng_file(self.rank))

    @torch.no_grad()
    def load(self, path: str) -> None:
        """Restores a `save`d checkpoint (of any layout): weights, fp32 main weights,
        Adam's moments and step (so the LR schedule), and (same world size) each rank's RNG."""
        root = Path(path)
        self.weights.weights_changed()
        state = json.loads((root / ckpt.STATE_FILE).read_text())
        if state["format"] != CHECKPOINT_FORMAT:
            raise ValueError(f"{path}: checkpoint format {state['format']}, expected 1")
        self.step = int(state["step"])
        weights = checkpoint_source(str(root), self.mapping)
        moments = {key: _SuffixSource(root / ckpt.OPTIMIZER_FILE, key, weights) for key in MOMENTS}
        self._load_weights(weights, moments)
        # The schedule is a function of the step count (this run's config, as with fsdp).
        self.scheduler = self._scheduler()
        if self.step:
            self.scheduler.step(increment=self.step)
        rng_path = root / ckpt.rng_file(self.rank)
        if state["world_size"] == self.world_size and rng_path.is_file():
            with safe_open(str(rng_path), "pt") as f:
                torch.set_rng_state(f.get_tensor("cpu"))
                if self.device.type == "cuda" and "cuda" in f.keys():  # noqa: SIM118
                    torch.cuda.set_rng_state(f.get_tensor("cuda"), self.device)

    # -- memory ----------------------------------------------------------------------------------

    def sleep(self) -> None:
        """Weights, gradient buffers and optimizer state to pinned host memory, freeing the GPU
        for a colocated engine. A no-op on CPU ranks."""
        if self.device.type != "cuda":
            return
        grads = [b.grad_data for b in [*self.ddp.buffers, *self.ddp.expert_parallel_buffers]]
        self._offload.offload(self._device_tensors(), discard=grads)

    def wake(self) -> None:
        if self.device.type == "cuda":
            self._offload.restore()

    def _device_tensors(self) -> Iterator[torch.Tensor]:
        yield from self.ddp.module.parameters()
        yield from self.ddp.module.buffers()
        for buffer in [*self.ddp.buffers, *self.ddp.expert_parallel_buffers]:
            if buffer.param_data is not None:
                yield buffer.param_data
        for opt_state in _adam_states(self.optimizer, with_params=True):
            yield from (v for v in opt_state.values() if isinstance(v, torch.Tensor) and v.is_cuda)

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


# -- helpers ------------------------------------------------------------------------------------


def _default_dtype(setup: TrainSetup, device: torch.device) -> str:
    """Without `train.dtype`: fp32 on CPU ranks; on GPUs the run's precision's (what engines
    compute in: bf16 or fp32), so trainer and engines agree; bf16 for any other."""
    if device.type != "cuda":
        return "float32"
    rollout = setup.precision.rollout_dtype
    return rollout if rollout in ("float32", "bfloat16") else "bfloat16"


def _finalize_summed(model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
    """megatron-core's `finalize_model_grads` without the division by the token count."""
    finalize_model_grads(model, None, **kwargs)


def _loss_func(
    loss_of: Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]],
    mb: MicroBatch,
    output: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    loss, reported = loss_of(mb, output)
    tokens = torch.tensor(0 if mb.is_padding else mb.num_tokens, dtype=torch.int)
    return loss, tokens.to(output.device), reported


def _adam_states(optimizer: Any, with_params: bool = False) -> Iterator[dict[str, Any]]:
    """Every Adam state dict of the optimizer (and, with_params, {"param": main weight})."""
    for opt in optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            for main in group["params"]:
                if with_params:
                    yield {"param": main}
                if main in opt.optimizer.state:
                    yield opt.optimizer.state[main]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return out.copy_(t.detach())


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


__all__ = ["MegatronTrainer", "TensorSource"]
