"""AdamW whose moments live in host memory (`train.optimizer_offload`).

fp32 master weights, fp32 gradients and AdamW's two fp32 moments are 16 bytes a parameter: 131 GB
for an 8B model, more than one H200 holds beside anything else. Here the moments (8 of the 16
bytes) stay in pinned host memory, and a step streams them through the GPU a chunk of parameters
at a time: each chunk's moments go to the GPU, torch's own AdamW updates that chunk, and they go
back. The GPU holds one chunk's moments at a time; the price is moving the moments across the
host link twice a step.

It is `torch.optim.AdamW` itself, with the same state (`exp_avg`, `exp_avg_sq`, `step`) under
the same keys, so checkpoints, `state_dict` and the learning-rate schedule see an ordinary AdamW;
only where the moments rest differs. Sharded (DTensor) parameters keep DTensor moments whose
local shards rest on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from miles.torch.train import config as train_config


class HostAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` with its moments in pinned host memory between steps."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        chunk_params: int | None = None,
        **adamw: Any,
    ) -> None:
        super().__init__(params, **adamw)
        self.chunk_params = chunk_params or train_config.OPTIMIZER_CHUNK_PARAMS

    def _chunks(self) -> Iterator[list[dict[str, Any]]]:
        """The param groups, cut into chunks of about `chunk_params` parameters (each chunk a
        list of groups with the hyper-parameters of the whole group, as set now)."""
        chunk: list[dict[str, Any]] = []
        size = 0
        for group in self.param_groups:
            current: list[torch.Tensor] = []
            for p in group["params"]:
                current.append(p)
                size += p.numel()
                if size >= self.chunk_params:
                    chunk.append({**group, "params": current})
                    yield chunk
                    chunk, current, size = [], [], 0
            if current:
                chunk.append({**group, "params": current})
        if chunk:
            yield chunk

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        groups = self.param_groups
        try:
            for chunk in self._chunks():
                params = [p for g in chunk for p in g["params"]]
                self._move_state(params, to_host=False)
                self.param_groups = chunk
                super().step()
                self._move_state(params, to_host=True)
        finally:
            self.param_groups = groups
        if any(p.is_cuda for g in groups for p in g["params"]):
            torch.cuda.synchronize()  # the copies to pinned memory are asynchronous
        return loss

    def to_host(self) -> None:
        """Every moment to host memory (after loading a checkpoint onto the device)."""
        self._move_state([p for g in self.param_groups for p in g["params"]], to_host=True)
        if any(p.is_cuda for g in self.param_groups for p in g["params"]):
            torch.cuda.synchronize()

    def _move_state(self, params: list[torch.Tensor], *, to_host: bool) -> None:
        for p in params:
            state = self.state.get(p)
            if not state or not p.is_cuda:
                continue
            for key, value in state.items():
                if key == "step" or not isinstance(value, torch.Tensor):
                    continue  # AdamW's step count is a host scalar already
                state[key] = _to_host(value) if to_host else _to_device(value, p)


def _to_host(value: torch.Tensor) -> torch.Tensor:
    local = _local(value)
    if local.device.type == "cpu":
        return value
    host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
    host.copy_(local, non_blocking=True)
    return _rewrapped(value, host)


def _to_device(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    local, device = _local(value), _local(like).device
    if local.device == device:
        return value
    return _rewrapped(value, local.to(device, non_blocking=True))


def _rewrapped(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` in `value`'s place: a DTensor of the same layout over it, or `local` itself."""
    if not isinstance(value, DTensor):
        return local
    return DTensor.from_local(
        local, value.device_mesh, value.placements, run_check=False,
        shape=value.shape, stride=value.stride(),
    )  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
