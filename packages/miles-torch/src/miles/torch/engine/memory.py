"""What the planner counts for a `torch` rollout engine (see miles.core.memory)."""

from __future__ import annotations

from miles.core.memory import GENERIC_ROLLOUT_ADVICE, RolloutBytes, RolloutInputs, engine
from miles.torch.engine.config import TorchEngineConfig


def torch_engine_memory(inputs: RolloutInputs, config: TorchEngineConfig) -> RolloutBytes:
    """The native engine runs up to `max_batch_size` sequences and prefills every admitted
    prompt in one forward (no chunking)."""
    return engine(
        inputs,
        max_batch_size=config.max_batch_size,
        prefill_chunk_tokens=None,
        advice={
            **GENERIC_ROLLOUT_ADVICE,
            "kv_cache": "lower rollout.max_batch_size (the engine's concurrency)",
        },
    )
