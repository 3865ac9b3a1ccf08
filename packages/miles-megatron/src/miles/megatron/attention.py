"""Megatron-core core attention on torch's variable-length FlashAttention.

Megatron's local `DotProductAttention` refuses packed (THD) batches and builds full
[b, h, s, s] scores. This module takes its place in the local layer spec: a packed micro-batch
(sequences concatenated, `PackedSeqParams` with cumulative lengths) attends within each
sequence, causally, through the same kernel as the fsdp backend (`miles.torch.train.
packed_attention`: FlashAttention on CUDA in bf16, one SDPA call per sequence elsewhere).
Unpacked [s, b] rows are causal sequences each (right padding needs no mask).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from miles.torch.train.packed_attention import packed_attention


class PackedCoreAttention(MegatronModule):  # type: ignore[misc]  # megatron-core: untyped
    """Causal core attention for packed (THD) and unpacked (SBHD) batches."""

    is_causal = True  # read by packed_attention

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        **_: Any,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"PackedCoreAttention has no dropout (attention_dropout={dropout}); RL training "
                "runs without it"
            )
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise ValueError(
                "PackedCoreAttention is causal within each sequence and takes no mask or bias: "
                "pass packed sequences (PackedSeqParams) or right-padded rows"
            )
        if packed_seq_params is not None:  # THD: query [tokens, heads, dim]
            q, k, v = (t.transpose(0, 1)[None] for t in (query, key, value))
            out, _ = packed_attention(
                self,
                q,
                k,
                v,
                None,
                scaling=self.scale,
                cu_seq_lens_q=packed_seq_params.cu_seqlens_q,
                max_length_q=int(packed_seq_params.max_seqlen_q),
            )
            return out[0].reshape(query.shape[0], -1)
        # SBHD: [seq, batch, heads, dim] -> SDPA's [batch, heads, seq, dim]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        gqa = k.shape[1] != q.shape[1]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa
        )
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
