# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
"""`checksum.content_hash`'s word mixing as Triton kernels: a single read of each tensor, block
sums of both lanes, no host sync. The arithmetic is the same function as the torch code in
`checksum` (there emulated in int64, here in native uint32), so CPU and GPU agree.

`grouped_lanes` hashes many tensors in one launch (their addresses in a table): a model's few
hundred weights cost one launch and two small reductions instead of a handful of kernels and
allocations each, which is what a per-tensor checksum spent its time on (about 0.1 ms a tensor
of host work on an H200, against microseconds of reading).
"""

from __future__ import annotations

import itertools

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


def grouped_lanes(words: list[torch.Tensor], chunk_words: int) -> torch.Tensor:
    """[len(words), 2] int64 on their device: each tensor's two lanes summed over all its chunks
    (mod 2**64, in int64 wrap-around), equal to summing `chunk_sums`' rows. All of `words` are
    contiguous int32 views on one device where `available`."""
    device = words[0].device
    blocks = [-(-w.numel() // BLOCK) for w in words]
    # Per tensor: its address, its words, its first block; per block: its tensor.
    starts = itertools.accumulate(blocks, initial=0)
    table = torch.tensor(
        [[w.data_ptr(), w.numel(), first] for w, first in zip(words, starts, strict=False)],
        dtype=torch.int64,
    ).to(device, non_blocking=True)
    owner = torch.repeat_interleave(
        torch.arange(len(words), device=device),
        torch.tensor(blocks, dtype=torch.int64).to(device, non_blocking=True),
        output_size=sum(blocks),
    )
    partial = torch.empty((sum(blocks), 2), dtype=torch.int64, device=device)
    if partial.numel():
        _grouped_kernel[(sum(blocks),)](table, owner, partial, CHUNK=chunk_words, BLOCK=BLOCK)
    lanes = torch.zeros((len(words), 2), dtype=torch.int64, device=device)
    return lanes.index_add_(0, owner, partial)


if triton is not None:

    @triton.jit
    def _mix32(x):
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D).to(tl.uint32)
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B).to(tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _block_lanes(words_ptr, offs, n, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Both lanes of one block of words (at `offs` within its tensor) into out_ptr[0:2]."""
        mask = offs < n
        w = tl.load(words_ptr + offs, mask=mask, other=0).to(tl.uint32, bitcast=True)
        within = (offs % CHUNK).to(tl.uint32)
        chunk = (offs // CHUNK + 1).to(tl.uint32)
        salt = _mix32(within) ^ _mix32(chunk)
        zero = tl.zeros((BLOCK,), dtype=tl.uint64)
        first = tl.where(mask, _mix32(w ^ salt).to(tl.uint64), zero)
        second = tl.where(mask, (w * ((salt & 0xFFFF) | 1)).to(tl.uint32).to(tl.uint64), zero)
        tl.store(out_ptr, tl.sum(first, axis=0).to(tl.int64, bitcast=True))
        tl.store(out_ptr + 1, tl.sum(second, axis=0).to(tl.int64, bitcast=True))

    @triton.jit
    def _lanes_kernel(words_ptr, n, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        _block_lanes(words_ptr, offs, n, out_ptr + 2 * pid, CHUNK, BLOCK)

    @triton.jit
    def _grouped_kernel(table_ptr, owner_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0).to(tl.int64)
        tensor = tl.load(owner_ptr + pid)
        words_ptr = tl.load(table_ptr + 3 * tensor).to(tl.pointer_type(tl.int32))
        n = tl.load(table_ptr + 3 * tensor + 1)
        first = tl.load(table_ptr + 3 * tensor + 2)
        offs = (pid - first) * BLOCK + tl.arange(0, BLOCK)
        _block_lanes(words_ptr, offs, n, out_ptr + 2 * pid, CHUNK, BLOCK)
