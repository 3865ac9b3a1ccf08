"""What the planner counts for a `torch` rollout engine (see miles.core.contracts.memory)."""

from __future__ import annotations

from dataclasses import replace

from miles.core.contracts.memory import GENERIC_ROLLOUT_ADVICE, RolloutBytes, RolloutInputs, engine
from miles.torch.engine.config import TorchEngineConfig


def torch_engine_memory(inputs: RolloutInputs, config: TorchEngineConfig) -> RolloutBytes:
    """The hf path runs up to `max_batch_size` sequences and prefills every admitted prompt in
    one forward; its cache grows with them. The paged path (`path: auto` takes it on GPUs for
    the families it supports) allocates its whole KV cache up front: `kv_cache_tokens`, else
    room for `max_batch_size` sequences of `max_context` tokens (less only when `mem_fraction`
    of the device cannot hold that), and prefills in chunks of `max_prefill_tokens`."""
    hf = engine(
        inputs,
        max_batch_size=config.max_batch_size,
        prefill_chunk_tokens=None,
        advice={
            **GENERIC_ROLLOUT_ADVICE,
            "kv_cache": "lower rollout.max_batch_size (the engine's concurrency)",
        },
    )
    # Families with per-sequence state (linear attention, sliding windows) run the hf path.
    if config.path == "hf" or inputs.shape.state_elems_per_seq:
        return hf
    tokens = config.kv_cache_tokens or config.max_batch_size * config.max_context
    paged = engine(
        inputs,
        max_batch_size=config.max_batch_size,
        prefill_chunk_tokens=config.max_prefill_tokens,
    )
    per_token = inputs.shape.kv_elems_per_token * inputs.compute_bytes
    return replace(
        paged,
        kv_cache=tokens * per_token / inputs.layout.gpus_per_engine,
        cache_tokens=tokens,
        notes=(
            "the paged KV cache is allocated whole: rollout.kv_cache_tokens, else "
            "max_batch_size x max_context tokens",
        ),
        advice={
            **GENERIC_ROLLOUT_ADVICE,
            "kv_cache": "set rollout.kv_cache_tokens, or lower rollout.max_context or "
            "rollout.max_batch_size (the paged cache is allocated whole)",
        },
    )
