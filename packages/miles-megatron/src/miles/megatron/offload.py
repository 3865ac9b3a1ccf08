"""Sleep and wake for a colocated trainer: the GPU storage behind every tensor handed in moves to
pinned host memory and back, in place.

megatron-core's parameters and gradients are views into its DDP buffers, and the optimizer holds
views and copies of its own; moving the tensors one by one would break the views. Resizing each
underlying storage to zero (after copying it out) keeps every view valid, as Megatron-LM's own
`offload_grad_buffers` does, and restoring it (resize back, copy in) brings them all back.
Gradient buffers are not copied: they are zeroed before every step anyway, so they come back as
zeros. The pinned host buffers are kept from one sleep to the next (pinning is slow).
`device_tensors` and `grad_buffers` are what a `MegatronTrainer` hands in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from miles.megatron.optimizer_state import adam_states


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as a flat uint8 tensor that shares it."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    out: torch.Tensor = t.set_(storage, 0, (storage.nbytes(),))  # type: ignore[call-overload]
    return out


def _storages(tensors: Iterable[torch.Tensor], seen: set[int]) -> list[torch.UntypedStorage]:
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


class HostOffload:
    """Copies of storages in host memory while the device's are released."""

    def __init__(self) -> None:
        self._kept: list[tuple[torch.UntypedStorage, int]] = []  # (storage, its bytes)
        self._dropped: list[tuple[torch.UntypedStorage, int]] = []
        self._host: list[torch.Tensor] = []  # pinned, by position, reused across sleeps

    @property
    def asleep(self) -> bool:
        return bool(self._kept or self._dropped)

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor], discard: Iterable[torch.Tensor] = ()) -> int:
        """Frees the storage of every tensor after keeping a host copy (of `discard`'s: none;
        they come back zeroed); returns the bytes copied out."""
        if self.asleep:
            return 0
        seen: set[int] = set()
        dropped = _storages(discard, seen)
        kept = _storages(tensors, seen)
        moved = 0
        for i, storage in enumerate(kept):
            n = storage.nbytes()
            if i >= len(self._host) or self._host[i].numel() != n:
                host = torch.empty(n, dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                self._host[i : i + 1] = [host]
            self._host[i].copy_(_bytes(storage), non_blocking=True)
            moved += n
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._kept = [(s, s.nbytes()) for s in kept]
        self._dropped = [(s, s.nbytes()) for s in dropped]
        for storage, _ in (*self._kept, *self._dropped):
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return moved

    @torch.no_grad()
    def restore(self) -> None:
        """Gives every storage its bytes back, where they were."""
        for i, (storage, n) in enumerate(self._kept):
            storage.resize_(n)
            _bytes(storage).copy_(self._host[i], non_blocking=True)
        for storage, n in self._dropped:
            storage.resize_(n)
            _bytes(storage).zero_()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._kept, self._dropped = [], []


def grad_buffers(ddp: Any) -> list[torch.Tensor]:
    """DDP's gradient buffers (dense and expert): what a sleep drops rather than keeps."""
    return [b.grad_data for b in [*ddp.buffers, *ddp.expert_parallel_buffers]]


def device_tensors(ddp: Any, optimizer: Any) -> Iterator[torch.Tensor]:
    """What a sleep keeps: the model's parameters and buffers, DDP's parameter buffers, and the
    optimizer's main weights and device state."""
    yield from ddp.module.parameters()
    yield from ddp.module.buffers()
    for buffer in [*ddp.buffers, *ddp.expert_parallel_buffers]:
        if buffer.param_data is not None:
            yield buffer.param_data
    for opt_state in adam_states(optimizer, with_params=True):
        yield from (v for v in opt_state.values() if isinstance(v, torch.Tensor) and v.is_cuda)
