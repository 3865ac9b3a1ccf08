"""SGLang's weight-update endpoints on the server side: a weight-update group joined by the
trainer (rank 0) and the engines, tensors received by broadcast; and loading from disk.

The group is what SGLang's `init_custom_process_group` makes: a TCP store at the trainer's
`master_address:master_port` (the trainer hosts it), a prefix store named by the group, and a
process group of `world_size` ranks over it, this engine being `rank_offset` (one rank: the
torch engine is one device). Gloo on CPU, NCCL on a CUDA engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from math import prod
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from miles.serve.store_deadline import within_deadline
from miles.sglang.protocol import BadRequest
from miles.torch.sync.group import broadcast_from_rank0, close_group

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def torch_dtype(name: str) -> torch.dtype:
    dtype = _DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise BadRequest(f"unknown dtype {name!r} (known: {', '.join(_DTYPES)})")
    return dtype


class UpdateGroup:
    """This engine's member of one weight-update group."""

    def __init__(
        self,
        name: str,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str,
        device: torch.device,
        timeout_s: float = 600.0,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and device.type != "cuda":
            raise BadRequest(
                "backend 'nccl' needs an engine on a GPU; this one runs on the CPU: use 'gloo'"
            )
        if not 0 < rank < world_size:
            raise BadRequest(f"rank_offset {rank} must be in [1, world_size={world_size})")
        self.name, self.device = name, device
        timeout = timedelta(seconds=timeout_s)
        store = within_deadline(
            master_address,
            master_port,
            timeout_s,
            lambda: dist.TCPStore(  # type: ignore[attr-defined]
                master_address, master_port, world_size, is_master=False, timeout=timeout
            ),
        )
        prefixed = dist.PrefixStore(name, store)  # type: ignore[attr-defined]
        self._pg: Any
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # each collective gives up after the same deadline
            self._pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def receive(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], flattened: bool
    ) -> list[tuple[str, torch.Tensor]]:
        """One broadcast from rank 0 per tensor, in list order; with `flattened`, one broadcast
        of the tensors concatenated flat (all of one dtype), cut apart here."""
        kinds = [torch_dtype(d) for d in dtypes]
        if flattened:
            if len(set(kinds)) > 1:
                raise BadRequest("load_format flattened_bucket needs one dtype for the bucket")
            sizes = [prod(s) for s in shapes]
            flat = torch.empty(sum(sizes), dtype=kinds[0], device=self.device)
            self._broadcast(flat)
            parts = torch.split(flat, sizes)
            return [(n, p.view(s)) for n, p, s in zip(names, parts, shapes, strict=True)]
        received = []
        for name, kind, shape in zip(names, kinds, shapes, strict=True):
            tensor = torch.empty(shape, dtype=kind, device=self.device)
            self._broadcast(tensor)
            received.append((name, tensor))
        return received

    def _broadcast(self, tensor: torch.Tensor) -> None:
        broadcast_from_rank0(self._pg, tensor)

    def close(self) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            close_group(pg)


def check_update(names: Any, dtypes: Any, shapes: Any) -> None:
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise BadRequest("names, dtypes and shapes must be non-empty lists of one length")
    if not all(isinstance(n, str) for n in names):
        raise BadRequest("names must be strings")
    if not all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes
    ):
        raise BadRequest("shapes must be lists of non-negative integers")


def safetensors_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint directory's (or file's) safetensors files."""
    path = Path(model_path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise BadRequest(f"no safetensors files at {model_path!r}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)
