"""Plain floating-point precisions: one dtype for the weights rollout engines hold."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class DtypePrecision:
    """Casts every synced tensor to one dtype, in which engines hold and compute.

    Training keeps the train backend's own numerics (fp32 master weights, its compute dtype):
    there is no layer to convert, so `convert_model` leaves the model as it is.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    @property
    def rollout_dtype(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def convert_model(self, model: torch.nn.Module) -> int:
        return 0

    def convert_for_rollout(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            yield name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def rollout_decoder(self, dtype: torch.dtype) -> None:
        return None  # engines load plain tensors as they are


def fp32() -> DtypePrecision:
    return DtypePrecision(torch.float32)


def bf16() -> DtypePrecision:
    return DtypePrecision(torch.bfloat16)
