"""What a `MegatronTrainer` builds once: megatron-core's parallel state, this rank's GPTModel in
`DistributedDataParallel`, its optimizer and the LR schedule.

Gradients are summed, never divided by a token count (`calculate_per_token_loss`, and a
`finalize_model_grads` without the division): `loss_weights` already fold the aggregation over
the global batch, so summed gradients are those of the one-shot global loss, as with fsdp.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.moe.router_replay import RouterReplay
from megatron.core.transformer.transformer_config import TransformerConfig
from miles.core.contracts.backends import TrainSetup
from miles.core.contracts.family import MegatronMapping
from miles.megatron.config import MegatronConfig
from miles.megatron.cpu_shims import run_megatron_on_cpu
from miles.megatron.head import bypass_output_layer
from miles.megatron.layout import ParallelLayout, Rank
from miles.megatron.model import build_gpt_model, transformer_config
from miles.torch.train.layers import compile_layer
from miles.torch.train.rms_norm import fuse_torch_rms_norms


def default_dtype(setup: TrainSetup, device: torch.device) -> str:
    """Without `train.dtype`: fp32 on CPU ranks; on GPUs the run's precision's (what engines
    compute in: bf16 or fp32), so trainer and engines agree; bf16 for any other."""
    if device.type != "cuda":
        return "float32"
    rollout = setup.precision.rollout_dtype
    return rollout if rollout in ("float32", "bfloat16") else "bfloat16"


def init_model_parallel(layout: ParallelLayout, device: torch.device, seed: int) -> Rank:
    """megatron-core's parallel state for `layout` (afresh: a process may build several
    trainers), its RNG streams on CUDA or the CPU shims elsewhere; this rank's coordinates."""
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
    )
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        run_megatron_on_cpu()
    return Rank(
        pp=parallel_state.get_pipeline_model_parallel_rank(),
        tp=parallel_state.get_tensor_model_parallel_rank(),
        ep=parallel_state.get_expert_model_parallel_rank(),
        etp=parallel_state.get_expert_tensor_parallel_rank(),
    )


def build_model_and_optimizer(
    cfg: MegatronConfig,
    mapping: MegatronMapping,
    layout: ParallelLayout,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[DistributedDataParallel, Any]:
    """This rank's GPTModel in DDP (gradients in fp32 buffers), and megatron-core's Adam over
    it (the distributed optimizer on CUDA when asked for)."""
    RouterReplay.clear_global_router_replay_instances()  # a class-level list per process
    moe = bool(mapping.transformer.get("num_moe_experts"))
    config = _transformer_config(cfg, mapping, layout, dtype, device, moe)
    module = build_gpt_model(mapping, layout, config)
    bypass_output_layer(module)
    if _compiles(cfg, device, moe):
        for layer in module.decoder.layers:  # only the forward: names and hooks stay
            compile_layer(layer, fallback=cfg.compile == "auto")
    else:
        # Eager torch RMSNorm is several elementwise kernels each way (65 ms of a W0 step on
        # an H100, docs/benchmarks.md); on CUDA the norms run Miles' fused kernels instead.
        fuse_torch_rms_norms(module, device)
    distributed = cfg.distributed_optimizer and device.type == "cuda"
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
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=distributed,
            clip_grad=0.0,  # clipped by Miles, after the non-finite check (`optimizer_step`)
        ),
        [ddp],
    )
    return ddp, optimizer


def _transformer_config(
    cfg: MegatronConfig,
    mapping: MegatronMapping,
    layout: ParallelLayout,
    dtype: torch.dtype,
    device: torch.device,
    moe: bool,
) -> TransformerConfig:
    recompute: dict[str, Any] = {}
    if cfg.activation_checkpointing:
        recompute = dict(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    dense_pipeline = {"moe_token_dispatcher_type": "alltoall"} if not moe else {}
    return transformer_config(
        mapping,
        layout,
        dtype,
        # alltoall makes CUDA streams at construction; the CPU shims run allgather (which
        # megatron-core refuses with a pipeline: MoE at PP > 1 runs on GPUs only).
        token_dispatcher="alltoall" if device.type == "cuda" else "allgather",
        calculate_per_token_loss=True,
        # Packed micro-batches differ in length: pipeline messages say their shapes.
        variable_seq_lengths=layout.pp > 1,
        # The routers' RouterReplay: replays records, or only compares with them ("off").
        moe_enable_routing_replay=True,
        **(dense_pipeline if layout.pp > 1 else {}),
        **recompute,
    )


def _compiles(cfg: MegatronConfig, device: torch.device, moe: bool) -> bool:
    """MoE layers stay eager under "auto": their token dispatch syncs with the host and
    their routers keep replay state, which would break the graph at every layer."""
    return cfg.compile == "on" or (cfg.compile == "auto" and device.type == "cuda" and not moe)


def _finalize_summed(model: Any, num_tokens: Any = None, **kwargs: Any) -> None:
    """megatron-core's `finalize_model_grads` without the division by the token count."""
    finalize_model_grads(model, None, **kwargs)


def keep_padding_row(module: Any, model_path: str, tp_rank: int) -> None:
    """transformers' embeddings hold their padding token's row fixed (`padding_idx`: no
    gradient ever reaches it); megatron-core's have no such row, so its gradient is zeroed
    here. It matters: a padding token in a sequence embeds to zeros, whose norm's gradient
    is huge."""
    from miles.core.contracts.family import text_config
    from miles.core.registry.families import read_config

    config = read_config(model_path) or {}
    pad = text_config(config).get("pad_token_id")
    if not isinstance(pad, int) or not parallel_state.is_pipeline_first_stage():
        return
    weight = module.embedding.word_embeddings.weight
    row = pad - tp_rank * weight.shape[0]
    if 0 <= row < weight.shape[0]:
        weight.register_hook(
            lambda grad: grad.index_fill(0, torch.tensor([row]).to(grad.device), 0.0)
        )


def lr_scheduler(optimizer: Any, cfg: MegatronConfig) -> OptimizerParamScheduler:
    """megatron-core's schedule from step 0: linear warmup from 0, then `lr_schedule` down to
    `min_lr_ratio * lr` at `total_steps`; weight decay constant."""
    decay_steps = max(cfg.total_steps, cfg.warmup_steps + 1)
    return OptimizerParamScheduler(
        optimizer,
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


def local_params(ddp: DistributedDataParallel) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by megatron-core name (TransformerEngine's
    `_extra_state` left out: no weights)."""
    return {
        k: v
        for k, v in ddp.module.state_dict(keep_vars=True).items()
        if not k.endswith("_extra_state")
    }
