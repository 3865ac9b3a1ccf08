"""What the planner counts for an `fsdp` train rank (see miles.core.memory)."""

from __future__ import annotations

from miles.core.memory import TrainBytes, TrainInputs, sharded_data_parallel
from miles.torch.train.config import LOGIT_CHUNK_ELEMENTS, FSDPConfig

_ADVICE = {
    "activations": "lower train.micro_batch_tokens or set train.activation_checkpointing: true",
    "weights": "use more train GPUs (FSDP shards the weights over every rank), or "
    "train.ref_mode: offload for a KL reference",
}


def fsdp_memory(inputs: TrainInputs, config: FSDPConfig) -> TrainBytes:
    """FSDP2: fp32 master weights, gradients and AdamW state sharded over every rank; a KL
    reference held as a second sharded copy unless `ref_mode: offload` keeps it on the host;
    logprobs from the output head a chunk of tokens at a time (`chunked_head`)."""
    return sharded_data_parallel(
        inputs,
        micro_batch_tokens=config.micro_batch_tokens,
        activation_checkpointing=config.activation_checkpointing,
        reference_copy=inputs.reference and config.ref_mode == "copy",
        advice=_ADVICE,
        logit_chunk_tokens=max(1, LOGIT_CHUNK_ELEMENTS // inputs.shape.vocab_size),
    )
