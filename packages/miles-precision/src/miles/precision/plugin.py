"""miles-precision's plugin module: the components it registers."""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import ComponentSpec, Kind, hookimpl, lazy


@hookimpl
def miles_register_precisions() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.PRECISION,
            "fp32",
            lazy("miles.precision.dtype:fp32"),
            "float32 training and rollout (exact; the CPU default)",
        ),
        ComponentSpec(
            Kind.PRECISION,
            "bf16",
            lazy("miles.precision.dtype:bf16"),
            "bfloat16 training compute and rollout weights",
        ),
    ]
