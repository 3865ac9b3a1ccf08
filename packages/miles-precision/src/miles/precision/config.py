"""The precisions' typed config sections. No torch import: `miles plugins list` stays cheap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Compute = Literal["bfloat16", "float32"]


@dataclass
class QuantConfig:
    # The dtype engines hold and compute in, and that non-quantized layers are sent in.
    compute: Compute = "bfloat16"
    # Who runs the quantized training layers. "torch": the pure-torch path (CPU and GPU).
    # TransformerEngine and torchao are not wired in yet: asking for them fails before launch.
    backend: Literal["torch", "transformer_engine", "torchao"] = "torch"

    def __post_init__(self) -> None:
        if self.backend != "torch":
            raise ValueError(
                f"backend {self.backend!r} is not available in this miles-precision version; "
                "use backend: torch (runs on CPU and GPU)"
            )


@dataclass
class Int4QATConfig(QuantConfig):
    group_size: int = 32  # weights per scale, along the input dimension

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"group_size must be an even number >= 2, got {self.group_size}")
