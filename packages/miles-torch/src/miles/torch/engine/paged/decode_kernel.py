# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
"""Paged decode attention as a Triton kernel: one query token per row against its cached K/V.

One program per (row, KV head, split): it loads the row's grouped-query heads that share the KV
head (padded to 16 rows, so both products run on tensor cores), walks its share of the row's
pages (split-K, so that short batches with long contexts still fill the GPU) with an online
softmax in fp32, and writes its output, or with several splits a partial output and its
log-sum-exp that a second kernel merges. The grid and every shape are fixed for a batch size,
and lengths are read on the device, so the kernel can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: attention falls back to torch there
    triton = None

TOKENS_PER_ITER = 64  # K/V tokens loaded per loop iteration (several pages)
TARGET_PROGRAMS = 512  # enough programs to keep every SM of a large GPU busy


if triton is not None:

    @triton.jit
    def _paged_decode_split(
        q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
        stride_qb, stride_qh,
        stride_kp, stride_ks, stride_kh,
        stride_tb,
        stride_ob, stride_oh, stride_os,
        stride_lb, stride_lh,
        scale,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        TOKENS: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(lens_ptr + row)
        per_split = tl.cdiv(tl.cdiv(seq_len, TOKENS), SPLITS) * TOKENS
        start = split * per_split
        end = tl.minimum(start + per_split, seq_len)

        g = tl.arange(0, GROUP_PAD)  # the query heads that share this KV head, padded to 16
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        q = tl.load(
            q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=g[:, None] < GROUP,
            other=0.0,
        )
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        t = tl.arange(0, TOKENS)
        for first in range(start, end, TOKENS):
            token = first + t
            valid = token < end
            page = tl.load(table_ptr + row * stride_tb + token // PAGE, mask=valid, other=0)
            offsets = (
                page.to(tl.int64)[:, None] * stride_kp
                + (token % PAGE)[:, None] * stride_ks
                + kv_head * stride_kh
                + d[None, :]
            )
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0)
            if IEEE:  # fp32 models: no TF32 rounding
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(scores - m_new[:, None])
            total = total * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        empty = total == 0.0  # a split past the row's end
        out = acc / tl.where(empty, 1.0, total)[:, None]
        lse = tl.where(empty, float("-inf"), m + tl.log(total))
        tl.store(
            out_ptr + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g[:, None] < GROUP,
        )
        if SPLITS > 1:
            tl.store(lse_ptr + row * stride_lb + heads * stride_lh + split, lse, mask=g < GROUP)

    @triton.jit
    def _merge_splits(
        part_ptr, lse_ptr, out_ptr, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
        stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        s = tl.arange(0, SPLITS)
        d = tl.arange(0, HEAD_DIM)
        lse = tl.load(lse_ptr + row * stride_lb + head * stride_lh + s)
        w = tl.exp(lse - tl.max(lse, axis=0))  # empty splits (lse -inf) weigh 0
        parts = tl.load(
            part_ptr + row * stride_pb + head * stride_ph + s[:, None] * stride_ps + d[None, :]
        )
        out = tl.sum(parts * w[:, None], axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + row * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def num_splits(rows: int, kv_heads: int, max_tokens: int) -> int:
    """Splits per row: enough programs to fill the GPU, none shorter than one loop iteration."""
    splits = 1
    while (
        rows * kv_heads * splits < TARGET_PROGRAMS
        and splits * 2 * TOKENS_PER_ITER <= max_tokens
        and splits < 32
    ):
        splits *= 2
    return splits


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [rows, heads, head_dim]; caches [pages, page_size, kv_heads, head_dim]; block_table
    [rows, max pages] int32; seq_lens [rows] int32. Returns [rows, heads, head_dim]."""
    if triton is None:
        raise RuntimeError("paged decode on CUDA needs Triton (it ships with CUDA builds of torch)")
    rows, heads, head_dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    splits = num_splits(rows, kv_heads, block_table.shape[1] * page)
    # One split writes the output directly; several write fp32 parts merged by `_merge_splits`.
    out = torch.empty((rows, heads, head_dim), dtype=q.dtype, device=q.device)
    parts = out.unsqueeze(2)
    lse = out  # unused with one split
    if splits > 1:
        parts = torch.empty((rows, heads, splits, head_dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((rows, heads, splits), dtype=torch.float32, device=q.device)
    _paged_decode_split[(rows, kv_heads, splits)](
        q, k_cache, v_cache, block_table, seq_lens, parts, lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        parts.stride(0), parts.stride(1), parts.stride(2),
        lse.stride(0), lse.stride(1),
        scale,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, PAGE=page,
        TOKENS=TOKENS_PER_ITER, SPLITS=splits, IEEE=q.dtype == torch.float32,
        num_warps=4, num_stages=2,
    )  # fmt: skip
    if splits > 1:
        _merge_splits[(rows, heads)](
            parts, lse, out,
            parts.stride(0), parts.stride(1), parts.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, SPLITS=splits,
        )  # fmt: skip
    return out
