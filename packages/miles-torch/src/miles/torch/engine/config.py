"""The typed config section of the `torch` rollout backend. No torch import: listing stays cheap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TorchEngineConfig:
    # Weight and compute dtype; by default the run's precision decides ("float32" for fp32).
    dtype: str = "float32"
    # Most sequences decoded together; more queue and join as others finish.
    max_batch_size: int = 64
    # Record each token's MoE routing: "off", "ids" (expert indices) or "ids+weights" (and gate
    # weights). Set by the run from moe.routing_replay; needs a family with a router adapter.
    record_routing: str = "off"

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.record_routing not in ("off", "ids", "ids+weights"):
            raise ValueError(
                f"record_routing must be off, ids or ids+weights, got {self.record_routing!r}"
            )
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
