"""Rotary embeddings of packed (THD) micro-batches in one pass.

megatron-core's torch path for packed sequences (`rope_utils._apply_rotary_pos_emb_thd`, used
without TransformerEngine's fused kernel) applies RoPE one sequence at a time, after a host sync
for the lengths: per layer, a loop of a few kernels per sequence, forward and backward. Here each
token's position within its sequence is computed on the device (`cu_seqlens` alone, no sync),
the frequencies are gathered for those positions, and one application covers the whole micro-
batch: the same numbers, as `_apply_rotary_pos_emb_bshd` computes them for each sequence.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron.core.models.common.embeddings import rope_utils

_megatron_thd = rope_utils._apply_rotary_pos_emb_thd


def _packed_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """`_apply_rotary_pos_emb_thd`'s contract: t [tokens, heads, dim], cu_seqlens [b + 1],
    freqs [max_len, 1, 1, dim] (or one row per packed token)."""
    cp_group = kwargs.get("cp_group")
    if cp_group is not None and cp_group.size() > 1:  # context parallelism: megatron-core's own
        theirs: torch.Tensor = _megatron_thd(
            t, cu_seqlens, freqs, rotary_interleaved, *args, **kwargs
        )
        return theirs
    mla = kwargs.get("mla_rotary_interleaved", kwargs.get("multi_latent_attention"))
    if mla is None:
        mla = bool(args[0]) if args else False
    mscale = float(kwargs.get("mscale", args[1] if len(args) > 1 else 1.0))
    n = t.shape[0]
    if freqs.shape[0] != n:  # positions restart at every sequence
        starts = cu_seqlens[:-1].long()
        offsets = torch.repeat_interleave(starts, cu_seqlens[1:].long() - starts, output_size=n)
        freqs = freqs[torch.arange(n, device=t.device) - offsets]
    out: torch.Tensor = rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), freqs, rotary_interleaved, mla, mscale
    ).squeeze(1)
    return out


def use_packed_rope() -> None:
    """Makes megatron-core's unfused THD RoPE the one-pass version (idempotent)."""
    rope_utils._apply_rotary_pos_emb_thd = _packed_thd
