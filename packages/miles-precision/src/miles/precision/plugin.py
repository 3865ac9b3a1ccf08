"""miles-precision's plugin module: the components it registers."""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import Capability, ComponentSpec, Kind, hookimpl, lazy
from miles.precision.config import (
    Int4QATConfig,
    QuantConfig,
    bf16_memory,
    fp8_memory,
    fp32_memory,
    int4_memory,
    mxfp8_memory,
)

QUANTIZED = frozenset({Capability.QUANTIZED})


@hookimpl
def miles_register_precisions() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.PRECISION,
            "fp32",
            lazy("miles.precision.dtype:fp32"),
            "float32 rollout weights (exact; the CPU default)",
            memory=fp32_memory,
        ),
        ComponentSpec(
            Kind.PRECISION,
            "bf16",
            lazy("miles.precision.dtype:bf16"),
            "bfloat16 rollout weights (training computes in the train backend's dtype)",
            memory=bf16_memory,
        ),
        ComponentSpec(
            Kind.PRECISION,
            "fp8",
            lazy("miles.precision.quantized:fp8_precision"),
            "fp8 e4m3 projections with 128x128 block scales (torch._scaled_mm); rollout gets fp8 "
            "weights + scales",
            QuantConfig,
            capabilities=QUANTIZED,
            memory=fp8_memory,
        ),
        ComponentSpec(
            Kind.PRECISION,
            "mxfp8",
            lazy("miles.precision.quantized:mxfp8_precision"),
            "mxfp8 projections (1x32 blocks, e8m0 scales; emulated on CPU and Hopper)",
            QuantConfig,
            capabilities=QUANTIZED,
            memory=mxfp8_memory,
        ),
        ComponentSpec(
            Kind.PRECISION,
            "int4-qat",
            lazy("miles.precision.quantized:int4_qat_precision"),
            "int4 quantization-aware training (symmetric, group-wise, straight-through); rollout "
            "gets packed int4 + group scales",
            Int4QATConfig,
            capabilities=QUANTIZED,
            memory=int4_memory,
        ),
    ]
