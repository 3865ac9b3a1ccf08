"""Sleep and wake for a colocated trainer: the GPU storage behind every tensor handed in moves to
pinned host memory and back, in place.

megatron-core's parameters and gradients are views into its DDP buffers, and the optimizer holds
views and copies of its own; moving the tensors one by one would break the views. Resizing each
underlying storage to zero (after copying it out) keeps every view valid, as Megatron-LM's own
`offload_grad_buffers` does, and restoring it (resize back, copy in) brings them all back.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage as a flat uint8 tensor that shares it."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    out: torch.Tensor = t.set_(storage, 0, (storage.nbytes(),))  # type: ignore[call-overload]
    return out


class HostOffload:
    """Copies of storages in host memory while the device's are released."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    @property
    def asleep(self) -> bool:
        return bool(self._saved)

    @torch.no_grad()
    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Frees the storage of every tensor after keeping a host copy; returns bytes moved."""
        if self._saved:
            return 0
        seen: set[int] = set()
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            device_bytes = _bytes(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device_bytes.is_cuda)
            host.copy_(device_bytes, non_blocking=True)
            self._saved.append((storage, host))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for storage, _ in self._saved:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return sum(host.numel() for _, host in self._saved)

    @torch.no_grad()
    def restore(self) -> None:
        """Gives every storage its bytes back, where they were."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _bytes(storage).copy_(host, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._saved = []
