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
from typing import Any

import numpy as np
import torch

from miles.torch.int_hash import MASK32, mix32
from miles.torch.sync import checksum_kernel

# Words hashed per pass: bounds the int64 temporaries to a few hundred MB on any tensor.
_CHUNK_WORDS = 1 << 24
# Tensors below this many bytes are hashed by sha256 on the host.
DEVICE_HASH_BYTES = 1 << 20
# Large GPU tensors hashed in one launch, at most (they stay alive until it is queued).
GROUP_BYTES = 1 << 30


def _salts(n: int, device: torch.device) -> torch.Tensor:
    """mix32(0..n-1): each word's salt within its chunk. One array per device, the longest asked
    for so far, sliced: every tensor's last chunk has its own length."""
    key = str(device)
    if key not in _SALTS or _SALTS[key].numel() < n:
        _SALTS[key] = mix32(torch.arange(n, device=device, dtype=torch.int64))
    return _SALTS[key][:n]


_SALTS: dict[str, torch.Tensor] = {}


def _chunk_sums(tensor: torch.Tensor) -> torch.Tensor:
    """[rows, 2] int64 on the tensor's device whose column sums are the two lanes: one row per
    chunk of words, and one for the last 1-3 bytes of a tensor that is not whole words."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a view at an odd place in a bucket: words need a copy
        raw = raw.clone()
    whole = raw.numel() // 4 * 4
    words = raw[:whole].view(torch.int32)
    if checksum_kernel.available(words):
        rows = [checksum_kernel.chunk_sums(words, _CHUNK_WORDS)]
    elif words.device.type == "cpu":
        rows = [_cpu_chunk_sums(words)]
    else:
        rows = _torch_chunk_sums(words)
    tail = raw[whole:].to(torch.int64)
    if tail.numel():
        place = 256 * torch.arange(1, tail.numel() + 1, device=tail.device)
        rows.append(torch.stack([mix32(tail + place).sum(), tail.new_zeros(())]).view(1, 2))
    if not rows:
        return torch.zeros((0, 2), dtype=torch.int64, device=raw.device)
    return torch.cat(rows)


def _torch_chunk_sums(words: torch.Tensor) -> list[torch.Tensor]:
    """The rows of int32 `words`, in torch int64 arithmetic on any device (the definition)."""
    rows = []
    for chunk, start in enumerate(range(0, words.numel(), _CHUNK_WORDS)):
        w = words[start : start + _CHUNK_WORDS].to(torch.int64) & MASK32
        # A word's salt depends on its chunk and its place in it: unique per position.
        salt = _salts(w.numel(), w.device) ^ int(mix32(torch.tensor(chunk + 1)))
        first = mix32(w ^ salt).sum()
        second = ((w * ((salt & 0xFFFF) | 1)) & MASK32).sum()
        rows.append(torch.stack([first, second]).view(1, 2))
    return rows


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """`mix32` in numpy uint32, whose products wrap mod 2**32 as `mul32` computes: in place."""
    x ^= x >> 16
    x *= np.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= np.uint32(0x846CA68B)
    x ^= x >> 16
    return x


def _np_salts(n: int) -> np.ndarray:
    """`_salts` for the CPU path (read-only: callers combine it into new arrays)."""
    global _NP_SALTS
    if _NP_SALTS.size < n:
        _NP_SALTS = _mix32_np(np.arange(n, dtype=np.uint32))
        _NP_SALTS.flags.writeable = False
    return _NP_SALTS[:n]


_NP_SALTS = np.zeros(0, dtype=np.uint32)


def _cpu_chunk_sums(words: torch.Tensor) -> torch.Tensor:
    """The torch path's rows for a CPU tensor, in numpy uint32 arithmetic (native wrap-around
    instead of int64 masking): the same sums, 11 times faster (536 MB: 24 s to 2.2 s on the
    2-core CPU machine)."""
    flat = words.numpy().view(np.uint32)
    rows = []
    for chunk, start in enumerate(range(0, flat.size, _CHUNK_WORDS)):
        w = flat[start : start + _CHUNK_WORDS]
        salt = _np_salts(w.size) ^ np.uint32(int(mix32(torch.tensor(chunk + 1))))
        first = _mix32_np(w ^ salt).sum(dtype=np.uint64)
        salt &= np.uint32(0xFFFF)
        salt |= np.uint32(1)
        salt *= w
        second = salt.sum(dtype=np.uint64)
        rows.append((int(first), int(second)))
    return torch.tensor(rows, dtype=torch.int64).view(-1, 2)


def _lanes(sums: list[torch.Tensor]) -> list[tuple[int, int]]:
    """The rows of `sums` (each [k, 2]: the two lanes of k tensors, or a tensor's rows of chunk
    sums for `content_hash`) as (first, second) mod 2**64, in order; one transfer per device."""
    host: list[Any] = [None] * len(sums)
    for device in {s.device for s in sums}:
        mine = [i for i, s in enumerate(sums) if s.device == device]
        joined = torch.cat([sums[i] for i in mine]).cpu().tolist()
        start = 0
        for i in mine:
            host[i] = joined[start : start + sums[i].shape[0]]
            start += sums[i].shape[0]
    return [(a % 2**64, b % 2**64) for rows in host for a, b in rows]


def content_hash(tensor: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit sums over the tensor's raw bytes, computed on the tensor's device."""
    return _lanes([_chunk_sums(tensor).sum(dim=0, keepdim=True)])[0]


def _header(name: str, tensor: torch.Tensor) -> bytes:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return f"{name}\0{dtype}\0{tuple(tensor.shape)}\0{tensor.numel()}\0".encode()


def _hashed_on_device(tensor: torch.Tensor) -> bool:
    return tensor.numel() * tensor.element_size() >= DEVICE_HASH_BYTES


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _host_digest(name: str, tensor: torch.Tensor) -> bytes:
    raw = _raw_bytes(tensor).cpu()
    return hashlib.sha256(_header(name, tensor) + raw.numpy().tobytes()).digest()


def _host_digests(small: dict[str, torch.Tensor]) -> dict[str, bytes]:
    """`_host_digest` of each tensor, with one transfer per device for all their bytes."""
    digests: dict[str, bytes] = {}
    for device in {t.device for t in small.values()}:
        names = [n for n, t in small.items() if t.device == device]
        raws = [_raw_bytes(small[n]) for n in names]
        joined = torch.cat(raws).cpu().numpy().tobytes() if raws else b""
        start = 0
        for name, raw in zip(names, raws, strict=True):
            end = start + raw.numel()
            digests[name] = hashlib.sha256(_header(name, small[name]) + joined[start:end]).digest()
            start = end
    return digests


def _lanes_digest(header: bytes, lanes: tuple[int, int]) -> bytes:
    return hashlib.sha256(
        header + lanes[0].to_bytes(8, "little") + lanes[1].to_bytes(8, "little")
    ).digest()


def tensor_digest(name: str, tensor: torch.Tensor) -> bytes:
    """sha256 over (name, dtype, shape, size, then the raw bytes or, from 1 MiB, their content
    hash)."""
    if _hashed_on_device(tensor):
        return _lanes_digest(_header(name, tensor), content_hash(tensor))
    return _host_digest(name, tensor)


class Checksum:
    """`tensors_checksum` as tensors arrive: `add` each (name, tensor), or `add_all` a stream of
    them, then `hexdigest`.

    Large tensors are hashed as they stream by (their kernels queue on the device and the
    tensors may be freed at once; on a GPU, up to `GROUP_BYTES` of them in one launch); their
    sums come back together at the end, and so do the small tensors' bytes (copied aside: one
    transfer per device, not one per tensor, and a small view does not keep a large buffer
    alive)."""

    def __init__(self) -> None:
        self._small: dict[str, torch.Tensor] = {}
        self._headers: dict[str, bytes] = {}  # large tensors, in the order of `_sums`' rows
        self._sums: list[torch.Tensor] = []  # [k, 2] int64 lanes of k large tensors each
        self._pending: list[torch.Tensor] = []  # int32 words waiting for one grouped launch
        self._pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._small or name in self._headers:
            raise ValueError(f"tensor {name!r} appears twice")
        if not _hashed_on_device(tensor):
            self._small[name] = tensor.detach().clone()
            return
        self._headers[name] = _header(name, tensor)
        raw = _raw_bytes(tensor)
        # A word view needs whole, aligned words: a bf16 tensor at an odd place in a bucket
        # takes the per-tensor path.
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 and raw.data_ptr() % 4 == 0 else None
        if words is not None and checksum_kernel.available(words):
            if self._pending and self._pending[0].device != words.device:
                self._flush()
            self._pending.append(words)
            self._pending_bytes += raw.numel()
            if self._pending_bytes >= GROUP_BYTES:
                self._flush()
        else:
            self._flush()  # rows stay in arrival order
            self._sums.append(_chunk_sums(tensor).sum(dim=0, keepdim=True))

    def add_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            self.add(name, tensor)
        self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._sums.append(checksum_kernel.grouped_lanes(self._pending, _CHUNK_WORDS))
            self._pending, self._pending_bytes = [], 0

    def hexdigest(self) -> str:
        self._flush()
        digests = _host_digests(self._small)
        for (name, header), lanes in zip(self._headers.items(), _lanes(self._sums), strict=True):
            digests[name] = _lanes_digest(header, lanes)
        total = hashlib.sha256()
        for name in sorted(digests):
            total.update(digests[name])
        return total.hexdigest()


def tensors_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """Combines per-tensor digests in sorted name order: equal tensors give equal hashes on any
    device and in any order; the same values in another dtype do not."""
    checksum = Checksum()
    checksum.add_all(named)
    return checksum.hexdigest()
