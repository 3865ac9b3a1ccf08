"""A train rank's device and its membership of the train group's default process group."""

from __future__ import annotations

import torch
import torch.distributed as dist


def resolve_device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    return dev


def init_process_group(
    device: torch.device, addr: str, port: int, rank: int, world_size: int
) -> bool:
    """Join (or reuse) the default process group; True if this call created it."""
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(
                f"process group already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not {rank} of {world_size}"
            )
        return False
    # CPU collectives (barriers, checkpoint sync) go over gloo even on GPU trainers.
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size
    )
    return True
