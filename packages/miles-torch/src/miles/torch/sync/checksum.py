"""One weight checksum shared by the trainer and the rollout engines.

After a weight sync both sides hash their tensors with this function and compare the strings, so
it must not depend on where a tensor lives (CPU or GPU) or on the order tensors are produced in.
Tensors are hashed one at a time as they stream by; only a digest per name is kept.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """sha256 over (name, dtype, shape, raw bytes)."""
    t = tensor.detach()
    digest = hashlib.sha256(
        f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0".encode()
    )
    # Viewing as bytes works for every dtype, bfloat16 included, which numpy lacks.
    raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
    digest.update(raw.numpy().tobytes())
    return digest.digest()


def tensors_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Combines per-tensor digests in sorted name order: equal tensors give equal hashes on any
    device and in any order; the same values in another dtype do not."""
    digests: dict[str, bytes] = {}
    for name, tensor in named:
        if name in digests:
            raise ValueError(f"tensor {name!r} appears twice")
        digests[name] = tensor_digest(name, tensor)
    total = hashlib.sha256()
    for name in sorted(digests):
        total.update(digests[name])
    return total.hexdigest()
