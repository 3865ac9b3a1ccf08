"""What the planner counts for a `megatron` train rank (see miles.core.contracts.memory)."""

from __future__ import annotations

from miles.core.contracts.memory import TrainBytes, TrainInputs, model_parallel
from miles.megatron.config import MegatronConfig

# `miles.megatron.logprobs.CHUNK_ELEMENTS`, kept here without importing torch.
_LOGIT_CHUNK_ELEMENTS = 64 * 1024 * 1024
# The local spec's layers (unfused norms, SwiGLU and rotary embeddings) keep 1.7 times the
# activations a family counts per layer, measured on one H200 for the Qwen3-0.6B shape at 8192
# and 16384 tokens a micro-batch (2.63 against 1.55 MB a token; tools/bench/megatron_memory.py).
LOCAL_SPEC_LAYER_FACTOR = 1.7

_ADVICE = {
    "activations": "lower train.micro_batch_tokens or set train.activation_checkpointing: true",
    "weights": "raise train.parallel.tensor or train.parallel.pipeline (train.parallel.expert "
    "for MoE experts)",
    "optimizer": "use more data-parallel ranks: the distributed optimizer shards its state "
    "over them",
}


def megatron_memory(inputs: TrainInputs, config: MegatronConfig) -> TrainBytes:
    """Megatron-core: this rank's TP x PP (x EP) share of the weights in the compute dtype and of
    the gradients in fp32 (DDP's buffers); fp32 main weights and Adam's two moments over data
    parallelism too (the distributed optimizer); the head's logprobs a chunk of tokens at a
    time, vocabulary-parallel. A KL reference waits in host memory."""
    local_vocab = max(1, inputs.shape.vocab_size // inputs.layout.tensor)
    return model_parallel(
        inputs,
        micro_batch_tokens=config.micro_batch_tokens,
        activation_checkpointing=config.activation_checkpointing,
        advice=_ADVICE,
        logit_chunk_tokens=max(1, _LOGIT_CHUNK_ELEMENTS // local_vocab),
        layer_factor=LOCAL_SPEC_LAYER_FACTOR,
    )
