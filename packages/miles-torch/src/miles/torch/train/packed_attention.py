"""Attention over sequences packed into one row: each token attends only within its own sequence.

Registered in transformers' attention interface as `miles_varlen`. A model loaded with it takes
its micro-batch as one row of concatenated sequences with per-sequence `position_ids` and the
cumulative sequence lengths (`cu_seq_lens_q`, the keyword transformers' flash-attention path
uses too), so no compute is spent on padding. transformers builds no mask for an implementation
it does not know, which is what packing wants.

On CUDA in bf16/fp16 it is torch's variable-length FlashAttention (`varlen_attn`), forward and
backward. Elsewhere (CPU, fp32) each sequence goes through `scaled_dot_product_attention` on
its own: the same numbers, one call per sequence.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface

NAME = "miles_varlen"
_FLASH_DTYPES = (torch.bfloat16, torch.float16)
_FLASH_MAX_HEAD_DIM = 256


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: query [1, Hq, N, D], key/value [1, Hkv, N, D(v)];
    returns ([1, N, Hq, Dv], None)."""
    if cu_seq_lens_q is None or max_length_q is None:
        raise ValueError(
            f"attention {NAME!r} needs packed inputs (cu_seq_lens_q, max_length_q): "
            "the model was loaded for packed micro-batches but called without them"
        )
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError(f"attention {NAME!r} takes one packed row and no attention mask")
    if dropout and module.training:
        raise ValueError(f"attention {NAME!r} has no dropout (got {dropout})")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"attention {NAME!r} is causal only")
    if _flash_fits(query, value, sliding_window):
        out = _flash(query, key, value, cu_seq_lens_q, max_length_q, scaling, sliding_window)
    else:
        out = _per_sequence(query, key, value, cu_seq_lens_q, scaling, sliding_window)
    return out.unsqueeze(0), None


def _flash_fits(query: torch.Tensor, value: torch.Tensor, sliding_window: int | None) -> bool:
    head_dim = max(query.shape[-1], value.shape[-1])
    return (
        query.is_cuda
        and query.dtype in _FLASH_DTYPES
        and head_dim <= _FLASH_MAX_HEAD_DIM
        and head_dim % 8 == 0
        and (sliding_window is None or _varlen().window_size)
    )


def _flash(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    max_len: int,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """[N, Hq, Dv] through torch's varlen FlashAttention."""
    varlen = _varlen()
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    value_dim = v.shape[-1]
    if value_dim < q.shape[-1]:  # e.g. multi-latent attention: V narrower than Q/K
        v = F.pad(v, (0, q.shape[-1] - value_dim))
    kwargs: dict[str, Any] = {"scale": scaling}
    if k.shape[1] != q.shape[1]:  # grouped-query attention
        if varlen.enable_gqa:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    # Causal is the window (-1, 0); a sliding window of W keys is (W - 1, 0).
    left = -1 if sliding_window is None else sliding_window - 1
    if varlen.is_causal:
        kwargs["is_causal"] = True
    if varlen.window_size and (sliding_window is not None or not varlen.is_causal):
        kwargs["window_size"] = (left, 0)
    cu = cu_seq_lens.to(torch.int32)
    out: torch.Tensor = varlen.fn(
        q.contiguous(), k.contiguous(), v.contiguous(), cu, cu, max_len, max_len, **kwargs
    )
    return out[..., :value_dim]


@dataclass(frozen=True)
class _Varlen:
    """torch's `varlen_attn` and which of its keywords this torch has (they changed between
    releases: early ones take `is_causal`, later ones express causality as a window)."""

    fn: Callable[..., Any]
    is_causal: bool
    window_size: bool
    enable_gqa: bool


@cache
def _varlen() -> _Varlen:
    params = inspect.signature(varlen_attn).parameters
    return _Varlen(
        fn=varlen_attn,
        is_causal="is_causal" in params,
        window_size="window_size" in params,
        enable_gqa="enable_gqa" in params,
    )


def _per_sequence(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None,
) -> torch.Tensor:
    """[N, Hq, Dv], one `scaled_dot_product_attention` call per sequence."""
    bounds = cu_seq_lens.tolist()
    gqa = key.shape[1] != query.shape[1]
    outs = []
    for start, end in itertools.pairwise(bounds):
        q, k, v = (t[:, :, start:end] for t in (query, key, value))
        n = end - start
        if sliding_window is not None and n > sliding_window:
            pos = torch.arange(n, device=query.device)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < sliding_window)
            out = F.scaled_dot_product_attention(q, k, v, mask, scale=scaling, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa
            )
        outs.append(out)
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


AttentionInterface.register(NAME, packed_attention)
