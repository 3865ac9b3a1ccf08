"""The broadcast transport of weight sync: a torch.distributed process group of its own.

Rank 0 is the trainer and ranks 1..N the engines (gloo on CPU, NCCL on GPU), independent of the
train group's default process group. Each sync moves the plan's buckets as raw bytes, one
broadcast per bucket, in plan order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from miles.core.contracts.weight_sync import SyncPlan, TensorMeta

GROUP_NAME = "weight_update_group"  # SGLang's default group_name


def broadcast_from_rank0(pg: Any, tensor: torch.Tensor) -> None:
    """One broadcast from rank 0 on a bare process group (not the default one)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()


def close_group(pg: Any) -> None:
    """Drops a process group; NCCL's is aborted, which also ends a broadcast still waiting for a
    peer that died."""
    with contextlib.suppress(Exception):  # a group whose peer died may not shut down cleanly
        gloo = isinstance(pg, dist.ProcessGroupGloo)
        (pg.shutdown if gloo else getattr(pg, "abort", pg.shutdown))()


def meta_of(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))


class SyncGroup:
    """A process group of its own, independent of the trainers' default group."""

    def __init__(
        self,
        host: str,
        port: int,
        world_size: int,
        rank: int,
        device: str = "cpu",
        timeout_s: float = 600.0,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Inside a Ray GPU actor only its own GPUs are visible: the current one is ours.
            self.device = torch.device("cuda", torch.cuda.current_device())
        timeout = timedelta(seconds=timeout_s)
        tcp = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)  # type: ignore[attr-defined]
        # Named as SGLang names its weight-update groups (`init_custom_process_group`), so an
        # SGLang server (or `miles serve`) can join the trainer's group as an engine.
        store = dist.PrefixStore(GROUP_NAME, tcp)  # type: ignore[attr-defined]
        self._pg: Any
        if self.device.type == "cuda":
            self._pg = dist.ProcessGroupNCCL(
                store, rank, world_size, dist.ProcessGroupNCCL.Options()
            )
        else:
            self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def close(self) -> None:
        """Drops the group (before a new one replaces it, e.g. after an engine restart). NCCL's
        is aborted, which also ends a broadcast still waiting for a peer that died."""
        pg, self._pg = self._pg, None
        if pg is not None:
            close_group(pg)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        broadcast_from_rank0(self._pg, tensor)

    def send(self, plan: SyncPlan, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: broadcasts the tensors, which must arrive in plan order. Returns bytes sent."""
        it = iter(named_tensors)
        sent = 0
        for bucket in plan.buckets:
            parts = []
            for meta in bucket.tensors:
                name, tensor = next(it)
                if name != meta.name or tuple(tensor.shape) != meta.shape:
                    raise RuntimeError(
                        f"weight sync: expected {meta.name} {meta.shape}, got {name} "
                        f"{tuple(tensor.shape)}; the model changed after the sync plan was made"
                    )
                part = tensor.detach().to(self.device, getattr(torch, meta.dtype)).reshape(-1)
                parts.append(_wire(part))
            flat = torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        if next(it, None) is not None:
            raise RuntimeError("weight sync: the trainer has more tensors than the sync plan")
        return sent

    def receive(self, plan: SyncPlan) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks 1..N: yields (name, tensor) views into each received bucket, in plan order."""
        for bucket in plan.buckets:
            flat = torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=self.device)
            self._broadcast(_wire(flat))  # fills `flat` (a byte view shares its memory)
            offset = 0
            for meta in bucket.tensors:
                yield meta.name, flat[offset : offset + meta.numel].view(meta.shape)
                offset += meta.numel


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What goes over the process group: 1-byte float formats (fp8) travel as their bytes,
    because not every backend (gloo) reduces or broadcasts them."""
    if tensor.is_floating_point() and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor
