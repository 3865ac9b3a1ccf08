"""Plain floating-point precisions: one dtype for training compute and for rollout weights."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class DtypePrecision:
    """Casts the training model and every synced tensor to one dtype.

    The optimizer keeps fp32 master weights when the trainer asks for them; this object only fixes
    the dtype that forward passes and rollout engines see.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def convert_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.dtype)

    def convert_for_rollout(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            yield name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor


def fp32() -> DtypePrecision:
    return DtypePrecision(torch.float32)


def bf16() -> DtypePrecision:
    return DtypePrecision(torch.bfloat16)
