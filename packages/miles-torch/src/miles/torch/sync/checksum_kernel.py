# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
"""`checksum.content_hash`'s word mixing as one Triton kernel: a single read of the tensor,
block sums of both lanes, no host sync. The arithmetic is the same function as the torch code
in `checksum` (there emulated in int64, here in native uint32), so CPU and GPU agree.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 4096


def available(words: torch.Tensor) -> bool:
    return triton is not None and words.is_cuda


def chunk_sums(words: torch.Tensor, chunk_words: int) -> torch.Tensor:
    """[chunks, 2] int64 on the device: each chunk's sums of the two lanes (each < 2**56)."""
    n = words.numel()
    blocks = -(-n // BLOCK)
    per_chunk = chunk_words // BLOCK
    partial = torch.zeros(
        (-(-blocks // per_chunk) * per_chunk, 2), dtype=torch.int64, device=words.device
    )
    if n:
        _lanes_kernel[(blocks,)](words, n, partial, CHUNK=chunk_words, BLOCK=BLOCK)
    return partial.view(-1, per_chunk, 2).sum(dim=1)


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D).to(tl.uint32)
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B).to(tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _lanes_kernel(words_ptr, n, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(words_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
        within = (offs % CHUNK).to(tl.uint32)
        chunk = (offs // CHUNK + 1).to(tl.uint32)
        salt = _mix32(within) ^ _mix32(chunk)
        zero = tl.zeros((BLOCK,), dtype=tl.uint64)
        first = tl.where(mask, _mix32(w ^ salt).to(tl.uint64), zero)
        second = tl.where(mask, (w * ((salt & 0xFFFF) | 1)).to(tl.uint32).to(tl.uint64), zero)
        tl.store(out_ptr + 2 * pid, tl.sum(first, axis=0).to(tl.int64, bitcast=True))
        tl.store(out_ptr + 2 * pid + 1, tl.sum(second, axis=0).to(tl.int64, bitcast=True))
