"""Weight-sync planning and the weight checksum, exactly: bucket boundaries at the byte budget,
every element size, and a checksum that sees names, dtypes, shapes and every byte."""

from __future__ import annotations

import pytest
import torch

from miles.core.weight_sync import (
    DTYPE_BYTES,
    Bucket,
    SyncPlan,
    TensorMeta,
    dtype_bytes,
    plan_buckets,
)
from miles.torch.sync.checksum import (
    DEVICE_HASH_BYTES,
    content_hash,
    tensor_digest,
    tensors_checksum,
)


def test_element_sizes_match_torch() -> None:
    for name, size in DTYPE_BYTES.items():
        assert dtype_bytes(name) == getattr(torch, name).itemsize == size, name
    with pytest.raises(ValueError, match="no element size known for dtype 'complex64'"):
        dtype_bytes("complex64")


def test_meta_sizes() -> None:
    meta = TensorMeta("w", (3, 4, 5), "bfloat16")
    assert (meta.numel, meta.num_bytes) == (60, 120)
    assert TensorMeta("s", (), "float32").numel == 1
    bucket = Bucket(
        "float32", (TensorMeta("a", (2, 3), "float32"), TensorMeta("b", (4,), "float32"))
    )
    assert bucket.numel == 10
    plan = SyncPlan((bucket, Bucket("int8", (TensorMeta("c", (7,), "int8"),))))
    assert plan.num_bytes == 47 and SyncPlan().num_bytes == 0


def test_buckets_fill_to_the_budget_exactly_and_keep_order() -> None:
    f32 = [TensorMeta(f"t{i}", (4,), "float32") for i in range(5)]  # 16 bytes each
    plan = plan_buckets(f32, bucket_bytes=32)  # exactly two fit
    assert [[t.name for t in b.tensors] for b in plan.buckets] == [
        ["t0", "t1"],
        ["t2", "t3"],
        ["t4"],
    ]
    assert all(b.dtype == "float32" for b in plan.buckets)
    assert [len(b.tensors) for b in plan_buckets(f32, bucket_bytes=31).buckets] == [1] * 5
    assert [len(b.tensors) for b in plan_buckets(f32, bucket_bytes=48).buckets] == [3, 2]
    assert plan_buckets([], bucket_bytes=32) == SyncPlan(())


def test_a_dtype_change_or_an_oversized_tensor_starts_a_bucket() -> None:
    metas = [
        TensorMeta("a", (2,), "float32"),
        TensorMeta("b", (2,), "bfloat16"),
        TensorMeta("c", (2,), "bfloat16"),
        TensorMeta("big", (100,), "bfloat16"),
        TensorMeta("d", (2,), "float32"),
    ]
    plan = plan_buckets(metas, bucket_bytes=64)
    assert [(b.dtype, [t.name for t in b.tensors]) for b in plan.buckets] == [
        ("float32", ["a"]),
        ("bfloat16", ["b", "c"]),
        ("bfloat16", ["big"]),
        ("float32", ["d"]),
    ]


def test_checksum_sees_every_property_of_every_tensor() -> None:
    torch.manual_seed(0)
    w = torch.randn(3, 4)
    base = tensors_checksum([("w", w), ("b", torch.ones(2))])
    assert base == tensors_checksum([("b", torch.ones(2)), ("w", w.clone())])  # order-free
    changed = [
        [("w", w), ("c", torch.ones(2))],  # a name
        [("w", w.reshape(4, 3)), ("b", torch.ones(2))],  # a shape
        [("w", w.to(torch.float64)), ("b", torch.ones(2))],  # a dtype
        [("w", w), ("b", torch.tensor([1.0, 1.0 + 2**-20]))],  # one value, slightly
        [("w", w)],  # a tensor missing
    ]
    assert len({base, *(tensors_checksum(c) for c in changed)}) == 1 + len(changed)
    with pytest.raises(ValueError, match="tensor 'w' appears twice"):
        tensors_checksum([("w", w), ("w", w)])


def test_digest_is_sha256_of_header_and_bytes_or_their_content_hash() -> None:
    import hashlib

    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()  # not contiguous
    want = hashlib.sha256(b"x\0int16\0(3, 2)\0" + b"6\0" + t.contiguous().numpy().tobytes())
    assert tensor_digest("x", t) == want.digest()
    big = torch.arange(DEVICE_HASH_BYTES // 4, dtype=torch.int32).reshape(-1, 2).t()
    first, second = content_hash(big)
    assert (first, second) == content_hash(big.contiguous())
    header = f"y\0int32\0(2, {big.shape[1]})\0{big.numel()}\0".encode()
    want = hashlib.sha256(header + first.to_bytes(8, "little") + second.to_bytes(8, "little"))
    assert tensor_digest("y", big) == want.digest()
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    total = hashlib.sha256(tensor_digest("a", bf) + tensor_digest("b", bf)).hexdigest()
    assert tensors_checksum([("b", bf), ("a", bf)]) == total


def test_content_hash_sees_every_bit_and_where_it_is() -> None:
    g = torch.Generator().manual_seed(0)
    t = torch.randint(-(2**31), 2**31 - 1, (4099,), generator=g, dtype=torch.int32)
    base = content_hash(t)
    seen = {base}
    for i in torch.randint(0, t.numel(), (200,), generator=g).tolist():
        bit = int(torch.randint(0, 31, (1,), generator=g))
        flipped = t.clone()
        flipped[i] ^= 1 << bit
        seen.add(content_hash(flipped))
    assert len(seen) == 201  # every single-bit flip shows, each differently
    swapped = t.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert content_hash(swapped) != base  # the same words in other places
    zeros = content_hash(torch.zeros(8, dtype=torch.int32))
    assert zeros != content_hash(torch.zeros(9, dtype=torch.int32))
    # Sizes that are not whole 32-bit words: the tail bytes count too.
    odd = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int8)
    changed = odd.clone()
    changed[4] = 6
    assert content_hash(odd) != content_hash(changed)
    assert content_hash(odd[:4]) != content_hash(odd)


@pytest.mark.parametrize("words", [1, 999, 1000, 4097])
def test_cpu_sums_are_the_torch_definition(monkeypatch: pytest.MonkeyPatch, words: int) -> None:
    """The CPU path (numpy uint32) gives the torch path's sums, chunk by chunk."""
    from miles.torch.sync import checksum

    monkeypatch.setattr(checksum, "_CHUNK_WORDS", 1000)
    g = torch.Generator().manual_seed(words)
    t = torch.randint(-(2**31), 2**31 - 1, (words,), generator=g, dtype=torch.int32)
    want = torch.cat(checksum._torch_chunk_sums(t))
    assert torch.equal(checksum._cpu_chunk_sums(t), want)
