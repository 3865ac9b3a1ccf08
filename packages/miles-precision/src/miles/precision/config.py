"""The precisions' typed config sections and memory models. No torch import: `miles plugins
list` and `miles recipes plan` stay cheap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from miles.core.contracts.memory import PrecisionBytes

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


# Bytes per element for the planner: activations and KV cache in the compute dtype; rollout
# weights in the format, with its scales (fp8: one fp32 per 128x128 block; mxfp8: one e8m0 per
# 32; int4: two bytes per 128).
def fp32_memory(config: None) -> PrecisionBytes:
    return PrecisionBytes(compute=4, rollout_weights=4)


def bf16_memory(config: None) -> PrecisionBytes:
    return PrecisionBytes(compute=2, rollout_weights=2)


def _compute_bytes(config: QuantConfig) -> float:
    return 2 if config.compute == "bfloat16" else 4


def fp8_memory(config: QuantConfig) -> PrecisionBytes:
    return PrecisionBytes(_compute_bytes(config), 1 + 4 / 128**2)


def mxfp8_memory(config: QuantConfig) -> PrecisionBytes:
    return PrecisionBytes(_compute_bytes(config), 1 + 1 / 32)


def int4_memory(config: Int4QATConfig) -> PrecisionBytes:
    return PrecisionBytes(_compute_bytes(config), 0.5 + 2 / 128)
