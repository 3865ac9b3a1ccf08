"""The weight checksum on a GPU (one grouped Triton launch for many tensors) equals the
definition computed on the CPU, whatever the tensors' sizes, dtypes and places in a bucket."""

from __future__ import annotations

import pytest
import torch

from miles.torch.sync.checksum import DEVICE_HASH_BYTES, GROUP_BYTES, Checksum, tensors_checksum

pytestmark = pytest.mark.gpu


def _named(device: str) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shapes = [
        ((1024, 1024), torch.bfloat16),  # 2 MiB
        ((3, 1000, 1001), torch.float32),  # not a whole number of blocks
        ((17_000_001,), torch.float32),  # more than one 2**24-word chunk
        ((262_145,), torch.bfloat16),  # 2 bytes over a word, under 1 MiB: sha256 on the host
        ((300,), torch.bfloat16),  # small: sha256 on the host
        ((600, 1024), torch.int64),
    ]
    out = [
        (f"w{i}", (torch.randn(shape, generator=g) * 100).to(dtype))
        for i, (shape, dtype) in enumerate(shapes)
    ]
    return [(n, t.to(device)) for n, t in out]


def test_gpu_checksum_equals_cpu_checksum() -> None:
    cpu = _named("cpu")
    assert tensors_checksum(_named("cuda")) == tensors_checksum(cpu)


def test_views_into_one_bucket_hash_like_separate_tensors() -> None:
    """A sync bucket: one dtype, tensors back to back, so after an odd-sized bf16 tensor the
    views sit at 2-byte offsets (those take the per-tensor path; the rest are grouped). The odd
    one goes first: the large views after it are all misaligned."""
    named = [(n, t.to(torch.bfloat16)) for n, t in _named("cpu") if t.is_floating_point()]
    named.sort(key=lambda nt: nt[1].numel() % 2 == 0)
    flat = torch.cat([t.reshape(-1) for _, t in named]).cuda()
    views, start = [], 0
    for name, t in named:
        views.append((name, flat[start : start + t.numel()].view(t.shape)))
        start += t.numel()
    assert any(v.data_ptr() % 4 and v.numel() * 2 >= DEVICE_HASH_BYTES for _, v in views)
    assert tensors_checksum(views) == tensors_checksum(named)


def test_a_flipped_bit_changes_the_checksum() -> None:
    named = _named("cuda")
    before = tensors_checksum(named)
    target = named[2][1]
    raw = target.view(torch.int32)
    raw[12_345_678] ^= 1 << 7
    assert tensors_checksum(named) != before


def test_streaming_in_groups_equals_one_pass() -> None:
    named = _named("cuda")
    streamed = Checksum()
    for name, tensor in named:
        streamed.add(name, tensor)
    assert streamed.hexdigest() == tensors_checksum(named)
    assert GROUP_BYTES >= 1 << 20
