"""What the planner counts for an `fsdp` train rank (see miles.core.contracts.memory)."""

from __future__ import annotations

import dataclasses

from miles.core.contracts.memory import TrainBytes, TrainInputs, sharded_data_parallel
from miles.torch.train.config import LOGIT_CHUNK_ELEMENTS, OPTIMIZER_CHUNK_PARAMS, FSDPConfig

_ADVICE = {
    "activations": "lower train.micro_batch_tokens or set train.activation_checkpointing: true",
    "optimizer": "set train.optimizer_offload: true (AdamW's moments in host memory, streamed "
    "through the GPU at each step), or use more train GPUs",
    "weights": "use more train GPUs (FSDP shards the weights over every rank), or "
    "train.ref_mode: offload for a KL reference",
}


def fsdp_memory(inputs: TrainInputs, config: FSDPConfig) -> TrainBytes:
    """FSDP2: fp32 master weights, gradients and AdamW state sharded over every rank; a KL
    reference held as a second sharded copy unless `ref_mode: offload` keeps it on the host;
    logprobs from the output head a chunk of tokens at a time (`chunked_head`)."""
    bytes_ = sharded_data_parallel(
        inputs,
        micro_batch_tokens=config.micro_batch_tokens,
        activation_checkpointing=config.activation_checkpointing,
        reference_copy=inputs.reference and config.ref_mode == "copy",
        advice=_ADVICE,
        logit_chunk_tokens=max(1, LOGIT_CHUNK_ELEMENTS // inputs.shape.vocab_size),
        # A LoRA base is frozen: the trainer keeps it in bf16 when it computes in bf16.
        frozen_bytes=2 if config.dtype == "bfloat16" else 4,
    )
    if not config.optimizer_offload or not bytes_.optimizer:
        return bytes_
    # HostAdamW: the moments rest on the host; the GPU holds one streamed chunk's at a time.
    on_device = min(bytes_.optimizer, 8.0 * OPTIMIZER_CHUNK_PARAMS)
    note = (
        f"train.optimizer_offload: AdamW's moments ({bytes_.optimizer / 1e9:.1f} GB) rest in "
        f"host memory; a step streams them through the GPU ({on_device / 1e9:.1f} GB at a time)"
    )
    return dataclasses.replace(bytes_, optimizer=on_device, notes=(*bytes_.notes, note))
