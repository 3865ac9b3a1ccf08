"""The weight-sync protocol: which tensors move from the trainer to the engines, in which buckets.

Both sides agree on a `SyncPlan` (names, shapes, dtypes, bucket boundaries) once, over Ray; each
sync then moves only raw bytes, bucket by bucket, in plan order: a broadcast over a process group
of its own (rank 0 the trainer, ranks 1..N the engines), or, colocated, one bucket at a time
handed over in place. Large flat buckets keep the number of transfers small. After a sync the
engines hold a new weight version, and a checksum on both sides proves the weights equal.

This module is the contract only (torch-free); the transports live with the backends
(miles-torch's `miles.torch.sync`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

# Bytes per element of the dtypes weights travel in (torch's names).
DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e8m0fnu": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"weight sync: no element size known for dtype {dtype!r}") from None


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "float32", as in torch.float32

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def num_bytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class Bucket:
    dtype: str
    tensors: tuple[TensorMeta, ...]

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)


@dataclass(frozen=True)
class SyncPlan:
    buckets: tuple[Bucket, ...] = field(default_factory=tuple)

    @property
    def num_bytes(self) -> int:
        return sum(b.numel * dtype_bytes(b.dtype) for b in self.buckets)


def plan_buckets(metas: Iterable[TensorMeta], bucket_bytes: int) -> SyncPlan:
    """Consecutive tensors of one dtype share a bucket up to `bucket_bytes`; order is kept, and a
    tensor larger than the budget gets a bucket of its own."""
    buckets: list[Bucket] = []
    current: list[TensorMeta] = []
    used = 0
    for meta in metas:
        size = meta.num_bytes
        if current and (meta.dtype != current[0].dtype or used + size > bucket_bytes):
            buckets.append(Bucket(current[0].dtype, tuple(current)))
            current, used = [], 0
        current.append(meta)
        used += size
    if current:
        buckets.append(Bucket(current[0].dtype, tuple(current)))
    return SyncPlan(tuple(buckets))
