"""The KL reference model (the initial policy, frozen), kept in one of two `ref_mode`s.

"copy": a second sharded model, built like the policy but frozen; it costs a second copy of the
weights on the device. "offload": this rank's shards of the initial weights wait in host memory
(`host_shards`) and are swapped into the policy model for the reference forward
(`swapped_in`), trading device memory for two host-device copies per `logprobs` call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def host_shards(model: torch.nn.Module) -> list[torch.Tensor]:
    """This rank's shards of `model`'s parameters, copied to (pinned) host memory."""
    return [_host_copy(_local(p)) for p in model.parameters()]


@contextmanager
def swapped_in(
    model: torch.nn.Module, shards: list[torch.Tensor], device: torch.device
) -> Iterator[None]:
    """Swaps the offloaded reference `shards` into `model`, and back afterwards.

    Copies go into the shards' storage in place, so FSDP's all-gathers see them; the
    policy's shards wait in host memory meanwhile.
    """
    params = [_local(p) for p in model.parameters()]
    saved = [_host_copy(p) for p in params]
    try:
        for p, ref in zip(params, shards, strict=True):
            p.copy_(ref, non_blocking=True)
        yield
    finally:
        for p, policy in zip(params, saved, strict=True):
            p.copy_(policy, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (DTensor) parameter, sharing its storage."""
    return param.to_local() if isinstance(param, DTensor) else param.data


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return out.copy_(t.detach())
