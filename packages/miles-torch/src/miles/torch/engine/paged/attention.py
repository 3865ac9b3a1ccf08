"""Attention over the paged KV cache: packed prefill and decode (K/V are written by `fused`).

The cache of one layer is a pair of [num_pages, page_size, kv_heads, head_dim] tensors; a token's
slot is page * page_size + offset. On CUDA, prefill runs torch's variable-length FlashAttention
over the packed batch and decode runs our Triton kernel (`decode_kernel`); on CPU both run as
scaled-dot-product attention, one sequence (prefill) or one padded batch (decode) at a time.
FlashAttention takes half precision only: fp32 prefill on CUDA takes the SDPA route as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from miles.torch.engine.paged import decode_kernel


@dataclass
class PrefillMeta:
    """A packed prefill step: row i computes queries cu_q[i]:cu_q[i+1] of the packed tokens and
    attends to its first k_lens[i] tokens, whose cache slots are `key_slots[cu_k[i]:cu_k[i+1]]`."""

    slots: torch.Tensor  # [new tokens] int64: where each new token's K/V go
    key_slots: torch.Tensor  # [sum k_lens] int64
    cu_q: torch.Tensor  # [rows + 1] int32
    cu_k: torch.Tensor  # [rows + 1] int32
    max_q: int
    max_k: int
    q_lens: list[int]
    k_lens: list[int]
    last: torch.Tensor  # [rows] int64: index of each row's last new token in the packed batch


@dataclass
class DecodeMeta:
    """A decode step: row b feeds one token at `positions[b]`, attends to seq_lens[b] tokens."""

    positions: torch.Tensor  # [rows] int64
    block_table: torch.Tensor  # [rows, max pages] int32
    seq_lens: torch.Tensor  # [rows] int32 (= positions + 1)
    page_size: int

    @property
    def slots(self) -> torch.Tensor:
        page = self.block_table.gather(1, (self.positions // self.page_size).unsqueeze(1))
        return page.squeeze(1).long() * self.page_size + self.positions % self.page_size


def prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PrefillMeta, scale: float
) -> torch.Tensor:
    """Causal attention of the packed queries [tokens, heads, head_dim] to their rows' cached
    keys (the new ones written already); row i's queries are its last q_lens[i] tokens."""
    keys = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, meta.key_slots)
    values = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, meta.key_slots)
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        return _flash_varlen(q, keys, values, meta, scale)
    out = torch.empty_like(q)
    starts_q, starts_k = meta.cu_q.tolist(), meta.cu_k.tolist()
    for i, (nq, nk) in enumerate(zip(meta.q_lens, meta.k_lens, strict=True)):
        qi = q[starts_q[i] : starts_q[i] + nq].transpose(0, 1)
        ki = keys[starts_k[i] : starts_k[i] + nk].transpose(0, 1)
        vi = values[starts_k[i] : starts_k[i] + nk].transpose(0, 1)
        # Query j sits at position nk - nq + j: it sees keys up to there (bottom-right causal).
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
        out[starts_q[i] : starts_q[i] + nq] = F.scaled_dot_product_attention(
            qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    return out


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMeta, scale: float
) -> torch.Tensor:
    """Each row's query [rows, heads, head_dim] against its first seq_lens[b] cached tokens."""
    if q.is_cuda:
        return decode_kernel.paged_decode(
            q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale
        )
    rows, pages = meta.block_table.shape
    size = k_cache.shape[1]
    index = meta.block_table.long()
    keys = k_cache[index].reshape(rows, pages * size, *k_cache.shape[2:]).transpose(1, 2)
    values = v_cache[index].reshape(rows, pages * size, *v_cache.shape[2:]).transpose(1, 2)
    visible = torch.arange(pages * size, device=q.device) < meta.seq_lens.unsqueeze(1)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys,
        values,
        attn_mask=visible[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(2)


_GQA_NATIVE: bool | None = None  # whether torch's varlen FlashAttention takes fewer K/V heads


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PrefillMeta, scale: float
) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    global _GQA_NATIVE
    args = (meta.cu_q, meta.cu_k, meta.max_q, meta.max_k)
    if _GQA_NATIVE is not False and k.shape[1] != q.shape[1]:
        try:
            out = varlen_attn(q, k, v, *args, scale=scale, window_size=(-1, 0))
            _GQA_NATIVE = True
            return cast(torch.Tensor, out)
        except (RuntimeError, ValueError):
            _GQA_NATIVE = False
    if k.shape[1] != q.shape[1]:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return cast(torch.Tensor, varlen_attn(q, k, v, *args, scale=scale, window_size=(-1, 0)))
