"""Weight-sync planning and the weight checksum, exactly: bucket boundaries at the byte budget,
every element size, and a checksum that sees names, dtypes, shapes and every byte."""

from __future__ import annotations

import pytest
import torch

from miles.core.contracts.weight_sync import (
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


def _mix32_ref(x: int) -> int:
    """lowbias32 in plain Python integers (independent of `mix32`'s int64 emulation)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = x * 0x7FEB352D & 0xFFFFFFFF
    x ^= x >> 15
    x = x * 0x846CA68B & 0xFFFFFFFF
    return x ^ (x >> 16)


def _content_hash_ref(data: bytes, chunk_words: int) -> tuple[int, int]:
    """The module docstring's definition, word by word: each little-endian 32-bit word mixed with
    its salt (its place in its chunk and the chunk's number), then the 1-3 tail bytes with their
    place."""
    first = second = 0
    whole = len(data) // 4
    for i in range(whole):
        word = int.from_bytes(data[4 * i : 4 * i + 4], "little")
        salt = _mix32_ref(i % chunk_words) ^ _mix32_ref(i // chunk_words + 1)
        first += _mix32_ref(word ^ salt)
        second += word * ((salt & 0xFFFF) | 1) & 0xFFFFFFFF
    for place, byte in enumerate(data[4 * whole :], start=1):
        first += _mix32_ref(byte + 256 * place)
    return first % 2**64, second % 2**64


@pytest.mark.parametrize("chunk_words", [2, 1 << 24])
def test_content_hash_equals_a_plain_python_reference(
    monkeypatch: pytest.MonkeyPatch, chunk_words: int
) -> None:
    from miles.torch.sync import checksum

    monkeypatch.setattr(checksum, "_CHUNK_WORDS", chunk_words)
    g = torch.Generator().manual_seed(chunk_words)
    data = torch.randint(0, 256, (23,), generator=g, dtype=torch.uint8)
    for n in (0, 1, 3, 4, 5, 8, 22, 23):  # every tail length; one word to several chunks
        t = data[:n].clone().view(torch.int8)
        assert content_hash(t) == _content_hash_ref(t.numpy().tobytes(), chunk_words), n
    assert content_hash(torch.zeros(0)) == (0, 0)


def _large(g: torch.Generator) -> list[tuple[str, torch.Tensor]]:
    """Tensors of at least DEVICE_HASH_BYTES (hashed by content) with every tail length, and a
    small one (hashed by sha256 on the host)."""
    shapes = [(DEVICE_HASH_BYTES + extra,) for extra in range(4)]  # every tail length, 0-3 bytes
    named = [
        (f"i8_{shape}", torch.randint(-128, 128, shape, generator=g, dtype=torch.int8))
        for shape in [*shapes, (1025, 1025)]
    ]
    named.append(("f32", torch.randn(DEVICE_HASH_BYTES // 4, generator=g).reshape(512, -1)))
    named.append(("bf16", torch.randn(DEVICE_HASH_BYTES // 2 + 3, generator=g).bfloat16()))
    named.append(("small", torch.randn(7, generator=g)))
    return named


def test_checksum_of_large_tensors_is_sha256_of_their_sorted_digests() -> None:
    import hashlib

    named = _large(torch.Generator().manual_seed(0))
    total = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda nt: nt[0]):
        total.update(tensor_digest(name, tensor))
    assert tensors_checksum(named) == total.hexdigest()
    assert tensors_checksum(reversed(named)) == total.hexdigest()
    changed = list(named)
    changed[3] = (changed[3][0], changed[3][1].clone())
    changed[3][1][-1] += 1  # the last tail byte of one tensor among many
    assert tensors_checksum(changed) != total.hexdigest()


def test_kernel_path_groups_launches_and_gives_the_definitions_checksum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the Triton kernel stood in for by the CPU definition: aligned whole-word tensors are
    grouped into launches of at least GROUP_BYTES (then flushed), the others hashed one by one
    between them, and the checksum is the one the definition gives."""
    from miles.torch.sync import checksum, checksum_kernel

    g = torch.Generator().manual_seed(1)
    mib = DEVICE_HASH_BYTES // 4  # float32 elements in 1 MiB
    named = [
        ("a", torch.randn(mib, generator=g)),
        ("b", torch.randn(mib, generator=g)),
        ("c", torch.randn(mib, generator=g)),
        ("odd", torch.randint(-128, 128, (DEVICE_HASH_BYTES + 3,), generator=g).to(torch.int8)),
        ("d", torch.randn(2 * mib, generator=g)),
        ("small", torch.randn(5, generator=g)),
        ("e", torch.randn(mib, generator=g)),
    ]
    want = tensors_checksum(named)

    def chunk_sums(words: torch.Tensor, chunk_words: int) -> torch.Tensor:
        assert chunk_words == checksum._CHUNK_WORDS
        return checksum._cpu_chunk_sums(words)

    launches: list[list[int]] = []

    def grouped_lanes(words: list[torch.Tensor], chunk_words: int) -> torch.Tensor:
        launches.append([w.numel() for w in words])
        return torch.cat([chunk_sums(w, chunk_words).sum(dim=0, keepdim=True) for w in words])

    monkeypatch.setattr(checksum_kernel, "available", lambda words: words.device.type == "cpu")
    monkeypatch.setattr(checksum_kernel, "chunk_sums", chunk_sums)
    monkeypatch.setattr(checksum_kernel, "grouped_lanes", grouped_lanes)
    monkeypatch.setattr(checksum, "GROUP_BYTES", 2 * DEVICE_HASH_BYTES)
    assert tensors_checksum(named) == want
    # a+b reach GROUP_BYTES; c waits until `odd` (per tensor) flushes it; d alone reaches it.
    assert launches == [[mib, mib], [mib], [2 * mib], [mib]]


def test_a_large_view_at_an_odd_place_in_a_bucket_hashes_like_its_own_tensor() -> None:
    """A bf16 bucket holding an odd-sized tensor, then one of 1 MiB or more: the second view
    starts 2 bytes into a word. Its checksum is that of the same values as a tensor of its own
    (it used to raise: int32 words cannot view bytes at such an offset)."""
    odd = torch.arange(3, dtype=torch.bfloat16)
    big = torch.randn(2**19 + 1, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    flat = torch.cat([odd, big])
    views = [("odd", flat[:3]), ("big", flat[3:])]
    assert views[1][1].storage_offset() * 2 % 4 == 2
    assert tensors_checksum(views) == tensors_checksum([("odd", odd), ("big", big)])
    assert tensor_digest("big", views[1][1]) == tensor_digest("big", big)


def test_a_cpu_tensor_is_summed_by_the_numpy_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU the words go to the numpy path (11 times faster than the torch definition, which
    stays for devices without the Triton kernel), and its rows are the hash's."""
    from miles.torch.sync import checksum

    calls: list[int] = []

    def numpy_path(words: torch.Tensor) -> torch.Tensor:
        calls.append(words.numel())
        return torch.tensor([[5, 7]])

    monkeypatch.setattr(checksum, "_cpu_chunk_sums", numpy_path)
    assert content_hash(torch.zeros(2**19, dtype=torch.float32)) == (5, 7)
    assert calls == [2**19]


def test_lanes_are_unsigned_64_bit_whatever_the_int64_sums_wrapped_to() -> None:
    """Lane sums accumulate in int64 and wrap past 2**63 (tensors over 8 GiB): each lane is
    read back mod 2**64, as the digest's 8 unsigned bytes need."""
    from miles.torch.sync import checksum

    sums = [torch.tensor([[-1, -(2**63)], [3, 4]]), torch.tensor([[2**63 - 1, -2]])]
    assert checksum._lanes(sums) == [(2**64 - 1, 2**63), (3, 4), (2**63 - 1, 2**64 - 2)]
