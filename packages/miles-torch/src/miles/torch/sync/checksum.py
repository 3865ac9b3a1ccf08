"""One weight checksum shared by the trainer and the rollout engines.

After a weight sync both sides hash their tensors with this function and compare the strings, so
it must not depend on where a tensor lives (CPU or GPU) or on the order tensors are produced in.

A tensor of 1 MiB or more is hashed where it lives, in integer arithmetic that is exact on any
device: every 32-bit word is mixed with its index, and two differently mixed lanes are summed
(mod 2**64). A changed, moved or swapped word changes the sums. Only two integers per tensor
travel to the host, where sha256 combines them with the tensor's name, dtype and shape. (A
host-side sha256 of every byte cost seconds per GB of weights.) Smaller tensors are hashed by
sha256 on the host, which is faster for them. The rule depends on the size alone, so every device
gives the same checksum. This guards against a sync that went wrong, not against an adversary.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

_MASK32 = 0xFFFFFFFF
# Words hashed per pass: bounds the int64 temporaries to a few hundred MB on any tensor.
_CHUNK_WORDS = 1 << 24
# Tensors below this many bytes are hashed by sha256 on the host.
DEVICE_HASH_BYTES = 1 << 20


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, in int64 without overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with good avalanche (Chris Wellons' lowbias32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _salts(n: int, device: torch.device) -> torch.Tensor:
    """mix32(0..n-1): each word's salt within its chunk (kept per device and length)."""
    key = (n, str(device))
    if key not in _SALTS:
        _SALTS[key] = _mix32(torch.arange(n, device=device, dtype=torch.int64))
    return _SALTS[key]


_SALTS: dict[tuple[int, str], torch.Tensor] = {}


def content_hash(tensor: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit sums over the tensor's raw bytes, computed on the tensor's device."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 4 * 4
    words = raw[:whole].view(torch.int32)
    lanes = [0, 0]
    for chunk, start in enumerate(range(0, words.numel(), _CHUNK_WORDS)):
        w = words[start : start + _CHUNK_WORDS].to(torch.int64) & _MASK32
        # A word's salt depends on its chunk and its place in it: unique per position.
        salt = _salts(w.numel(), w.device) ^ int(_mix32(torch.tensor(chunk + 1)))
        lanes[0] += int(_mix32(w ^ salt).sum())
        lanes[1] += int(((w * ((salt & 0xFFFF) | 1)) & _MASK32).sum())
    tail = raw[whole:].to(torch.int64)  # the last 1-3 bytes of an odd-sized tensor
    if tail.numel():
        place = 256 * torch.arange(1, tail.numel() + 1, device=tail.device)
        lanes[0] += int(_mix32(tail + place).sum())
    return lanes[0] % 2**64, lanes[1] % 2**64


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """sha256 over (name, dtype, shape, size, then the raw bytes or, from 1 MiB, their content
    hash)."""
    t = tensor.detach()
    header = f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{tuple(t.shape)}\0{t.numel()}\0"
    digest = hashlib.sha256(header.encode())
    if t.numel() * t.element_size() < DEVICE_HASH_BYTES:
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().tobytes())
    else:
        first, second = content_hash(t)
        digest.update(first.to_bytes(8, "little") + second.to_bytes(8, "little"))
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
