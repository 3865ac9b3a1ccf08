"""The fast forward of Llama-shaped decoders (Llama, Qwen2, Qwen3, Qwen3-MoE) over the paged
KV cache.

It runs on the Hugging Face model's own modules and parameters, with two fusions: each layer's
q/k/v projections become one matrix and a dense MLP's gate/up another. The fused matrices own
the storage and the Hugging Face parameters become views into them, so weights loaded by Hugging
Face name (a weight sync, a LoRA merge, a checksum) land in the fused matrices in place: no
copy, and CUDA graphs captured over them stay valid. MoE layers run the Hugging Face router and
our grouped experts (`moe`) over the experts' own 3-D parameters; with a `RouteCache` set, each
MoE layer's choice is written beside the token's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from miles.torch.engine.paged.attention import (
    DecodeMeta,
    PrefillMeta,
    decode_attention,
    prefill_attention,
)
from miles.torch.engine.paged.fused import qk_norm_rope_store, rms_norm, silu_mul
from miles.torch.engine.paged.moe import experts_forward, grouped
from miles.torch.engine.paged.routes import RouteCache

# Families whose decoder layer is: RMSNorm, attention (optional per-head q/k RMSNorm), residual,
# RMSNorm, gated MLP or top-k routed SiLU-gated experts, residual; RoPE that depends on the
# position only.
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model: Any) -> str | None:
    """Why the paged path cannot run `model` (None: it can)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} has no paged forward yet (have {', '.join(FAMILIES)})"
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if layer_types != {"full_attention"}:
        return f"layer types {sorted(layer_types)}: only full attention has a paged forward"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = (
        rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    )
    if rope_type not in _STATIC_ROPE:
        return f"RoPE type {rope_type!r} depends on the sequence length; the paged path needs static RoPE"
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        return f"activation {config.hidden_act!r}: the paged MLP is SiLU-gated"
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts") and not (
            hasattr(mlp, "gate") and hasattr(mlp.experts, "gate_up_proj")
        ):
            return f"MoE block {type(mlp).__name__} is not router + fused 3-D experts"
    return None


def _fuse(weights: list[nn.Parameter]) -> torch.Tensor:
    """One matrix from the row blocks `weights`; each parameter becomes a view of its block."""
    fused = torch.cat([w.data for w in weights])
    start = 0
    for w in weights:
        w.data = fused[start : start + w.shape[0]]
        start += w.shape[0]
    return fused


@dataclass
class _DenseMLP:
    gate_up: torch.Tensor
    down: nn.Linear

    def __call__(
        self, x: torch.Tensor, slots: torch.Tensor, routes: RouteCache | None
    ) -> torch.Tensor:
        out: torch.Tensor = self.down(silu_mul(F.linear(x, self.gate_up)))
        return out


@dataclass
class _MoE:
    router: nn.Module  # Hugging Face router: (logits, gate weights, expert indices)
    gate_up: torch.Tensor  # [experts, 2 * inter, hidden]
    down: torch.Tensor  # [experts, hidden, inter]
    index: int  # among the model's MoE layers: its column in the routing record

    def __call__(
        self, x: torch.Tensor, slots: torch.Tensor, routes: RouteCache | None
    ) -> torch.Tensor:
        _, weights, indices = self.router(x)
        if routes is not None:
            routes.write(self.index, slots, indices, weights)
        return experts_forward(x, indices, weights, self.gate_up, self.down)


@dataclass
class _Layer:
    input_norm: nn.Module
    post_norm: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: nn.Linear
    mlp: _DenseMLP | _MoE


class PagedModel:
    """Prefill and decode forwards of a supported Hugging Face causal LM over a paged cache."""

    def __init__(self, model: Any, max_context: int) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(reason)
        config = model.config
        self.hf = model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.num_layers = config.num_hidden_layers
        self.dtype = model.dtype
        self.max_context = max_context
        self.routes: RouteCache | None = None  # set by the runner when routing is recorded
        self.fuse()
        self.num_moe_layers = sum(isinstance(layer.mlp, _MoE) for layer in self.layers)
        self.top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
        # Why decode cannot be captured as CUDA graphs (None: it can).
        self.not_graphable: str | None = None
        if self.num_moe_layers and not grouped(model.device, self.dtype):
            self.not_graphable = f"MoE experts in {self.dtype} run one by one, syncing"
        positions = torch.arange(max_context, device=model.device).unsqueeze(0)
        probe = torch.empty(0, dtype=self.dtype, device=model.device)
        cos, sin = model.model.rotary_emb(probe, positions)
        self.cos, self.sin = cos[0], sin[0]  # [max_context, head_dim]

    def fuse(self) -> None:
        """(Re)build the fused q/k/v and gate/up matrices; call again after the model moved."""
        self.layers = []
        moe_layers = 0
        for layer in self.hf.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = [attn.q_proj, attn.k_proj, attn.v_proj]
            biases = [p.bias for p in projections]
            block: _DenseMLP | _MoE
            if hasattr(mlp, "experts"):
                experts = mlp.experts
                block = _MoE(mlp.gate, experts.gate_up_proj, experts.down_proj, moe_layers)
                moe_layers += 1
            else:
                block = _DenseMLP(_fuse([mlp.gate_proj.weight, mlp.up_proj.weight]), mlp.down_proj)
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm,
                    post_norm=layer.post_attention_layernorm,
                    q_norm=getattr(attn, "q_norm", None),
                    k_norm=getattr(attn, "k_norm", None),
                    qkv=_fuse([p.weight for p in projections]),
                    qkv_bias=None if biases[0] is None else _fuse(biases),
                    o_proj=attn.o_proj,
                    mlp=block,
                )
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv: torch.Tensor,
        meta: PrefillMeta | DecodeMeta,
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [rows, vocab] for the tokens `input_ids` [tokens] at `positions`, their K/V
        written into `kv` [layers, 2, pages, page_size, kv_heads, head_dim] on the way; `last`
        picks the tokens whose logits are wanted (default: all)."""
        hidden = self.hf.model.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cos, sin = self.cos[positions], self.sin[positions]
        slots = meta.slots
        for i, layer in enumerate(self.layers):
            x, residual = rms_norm(hidden, *_norm(layer.input_norm), residual)
            k_cache, v_cache = kv[i, 0], kv[i, 1]
            q = qk_norm_rope_store(
                F.linear(x, layer.qkv, layer.qkv_bias),
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                None if layer.q_norm is None else _norm(layer.q_norm),
                None if layer.k_norm is None else _norm(layer.k_norm),
                cos,
                sin,
                k_cache,
                v_cache,
                slots,
            )
            if isinstance(meta, PrefillMeta):
                attn = prefill_attention(q, k_cache, v_cache, meta, self.scale)
            else:
                attn = decode_attention(q, k_cache, v_cache, meta, self.scale)
            attn_out = layer.o_proj(attn.reshape(attn.shape[0], -1))
            x, residual = rms_norm(attn_out, *_norm(layer.post_norm), residual)
            hidden = layer.mlp(x, slots, self.routes)
        assert residual is not None
        if last is not None:
            hidden, residual = hidden[last], residual[last]
        hidden, _ = rms_norm(hidden, *_norm(self.hf.model.norm), residual)
        logits: torch.Tensor = self.hf.lm_head(hidden)
        return logits


def _norm(module: Any) -> tuple[torch.Tensor, float]:
    return module.weight, float(module.variance_epsilon)
