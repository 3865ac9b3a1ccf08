"""The typed config section of the `torch` rollout backend. No torch import: listing stays cheap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TorchEngineConfig:
    # Weight and compute dtype; null (the default): the run's precision decides ("float32" for
    # fp32, "bfloat16" for bf16 and the quantized formats' default compute).
    dtype: str | None = None
    # Most sequences decoded together; more queue and join as others finish.
    max_batch_size: int = 64

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
