"""Megatron-core mappings of GPT-style families: which Hugging Face weights (the names
transformers gives them in memory, which are the names Miles syncs and saves) make each parameter
of Megatron-core's GPTModel under its local layer spec."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from miles.core.family import MegatronWeight

_LAYER = "decoder.layers.{layer}."
_HF_LAYER = "model.layers.{layer}."


def attention_weights(layers: Sequence[int], *, qk_norm: bool) -> list[MegatronWeight]:
    """Pre-norm GQA attention without biases: input norm, fused QKV, output projection, per-head
    q/k norms."""
    at = tuple(layers)
    out = [
        MegatronWeight(
            _LAYER + "input_layernorm.weight", (_HF_LAYER + "input_layernorm.weight",), layers=at
        ),
        MegatronWeight(
            _LAYER + "self_attention.linear_qkv.weight",
            tuple(_HF_LAYER + f"self_attn.{p}_proj.weight" for p in "qkv"),
            join="qkv",
            split="column",
            layers=at,
        ),
        MegatronWeight(
            _LAYER + "self_attention.linear_proj.weight",
            (_HF_LAYER + "self_attn.o_proj.weight",),
            split="row",
            layers=at,
        ),
    ]
    if qk_norm:
        for ours, theirs in (("q_layernorm", "q_norm"), ("k_layernorm", "k_norm")):
            out.append(
                MegatronWeight(
                    _LAYER + f"self_attention.{ours}.weight",
                    (_HF_LAYER + f"self_attn.{theirs}.weight",),
                    layers=at,
                )
            )
    return out


def swiglu_weights(layers: Sequence[int]) -> list[MegatronWeight]:
    """A dense SwiGLU MLP after its pre-MLP norm."""
    at = tuple(layers)
    return [
        MegatronWeight(
            _LAYER + "pre_mlp_layernorm.weight",
            (_HF_LAYER + "post_attention_layernorm.weight",),
            layers=at,
        ),
        MegatronWeight(
            _LAYER + "mlp.linear_fc1.weight",
            (_HF_LAYER + "mlp.gate_proj.weight", _HF_LAYER + "mlp.up_proj.weight"),
            join="gate_up",
            split="column",
            layers=at,
        ),
        MegatronWeight(
            _LAYER + "mlp.linear_fc2.weight",
            (_HF_LAYER + "mlp.down_proj.weight",),
            split="row",
            layers=at,
        ),
    ]


def routed_experts_weights(layers: Sequence[int]) -> list[MegatronWeight]:
    """A routed-expert MLP as transformers 5 holds it: a linear router (`mlp.gate`) and the
    experts stacked in two tensors (`gate_up_proj` [experts, 2 x ffn, hidden], gate rows first;
    `down_proj` [experts, hidden, ffn]). Megatron holds one module per expert."""
    at = tuple(layers)
    experts = "mlp.experts.local_experts.{expert}."
    return [
        MegatronWeight(
            _LAYER + "pre_mlp_layernorm.weight",
            (_HF_LAYER + "post_attention_layernorm.weight",),
            layers=at,
        ),
        MegatronWeight(_LAYER + "mlp.router.weight", (_HF_LAYER + "mlp.gate.weight",), layers=at),
        MegatronWeight(
            _LAYER + experts + "linear_fc1.weight",
            (_HF_LAYER + "mlp.experts.gate_up_proj",),
            join="gate_up",
            split="column",
            layers=at,
        ),
        MegatronWeight(
            _LAYER + experts + "linear_fc2.weight",
            (_HF_LAYER + "mlp.experts.down_proj",),
            split="row",
            layers=at,
        ),
    ]


def outer_weights(*, tied: bool) -> list[MegatronWeight]:
    """Embeddings, the final norm and the output layer (absent when tied to the embeddings)."""
    out = [
        MegatronWeight(
            "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), split="vocab"
        ),
        MegatronWeight("decoder.final_layernorm.weight", ("model.norm.weight",)),
    ]
    if not tied:
        out.append(MegatronWeight("output_layer.weight", ("lm_head.weight",), split="vocab"))
    return out


def mla_weights(layers: Sequence[int], *, q_lora: bool) -> list[MegatronWeight]:
    """Multi-latent attention (DeepSeek-V3 style): low-rank query (or a plain one) and a
    compressed KV with its rotary part, each low-rank side normalised. Every projection is cut
    by tensor parallelism: the down projections' outputs (the latents) are gathered before their
    norms, as megatron-core's local spec does; the up projections are cut by heads."""
    at = tuple(layers)

    def w(ours: str, theirs: str, split: Literal["column", "row"] | None = None) -> MegatronWeight:
        return MegatronWeight(_LAYER + ours, (_HF_LAYER + theirs,), split=split, layers=at)

    out = [
        w("input_layernorm.weight", "input_layernorm.weight"),
        w(
            "self_attention.linear_kv_down_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "column",
        ),
        w("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        w("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", "column"),
        w("self_attention.linear_proj.weight", "self_attn.o_proj.weight", "row"),
    ]
    if q_lora:
        out += [
            w("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight", "column"),
            w("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
            w("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight", "column"),
        ]
    else:
        out.append(w("self_attention.linear_q_proj.weight", "self_attn.q_proj.weight", "column"))
    return out


def shared_experts_weights(layers: Sequence[int]) -> list[MegatronWeight]:
    """Shared experts beside routed ones (one SwiGLU MLP of all shared experts' width), and the
    router's expert bias (DeepSeek-V3's `e_score_correction_bias`)."""
    at = tuple(layers)
    return [
        MegatronWeight(
            _LAYER + "mlp.router.expert_bias",
            (_HF_LAYER + "mlp.gate.e_score_correction_bias",),
            layers=at,
        ),
        MegatronWeight(
            _LAYER + "mlp.shared_experts.linear_fc1.weight",
            (
                _HF_LAYER + "mlp.shared_experts.gate_proj.weight",
                _HF_LAYER + "mlp.shared_experts.up_proj.weight",
            ),
            join="gate_up",
            split="column",
            layers=at,
        ),
        MegatronWeight(
            _LAYER + "mlp.shared_experts.linear_fc2.weight",
            (_HF_LAYER + "mlp.shared_experts.down_proj.weight",),
            split="row",
            layers=at,
        ),
    ]
