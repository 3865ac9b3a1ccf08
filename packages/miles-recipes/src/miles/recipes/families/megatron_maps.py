"""Megatron-core mappings of GPT-style families: which Hugging Face weights (the names
transformers gives them in memory, which are the names Miles syncs and saves) make each parameter
of Megatron-core's GPTModel under its local layer spec."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from miles.core.contracts.family import MegatronWeight

Split = Literal["column", "row"] | None
Join = Literal["copy", "qkv", "gate_up"]


def _in_layers(
    layers: Sequence[int],
    ours: str,
    theirs: str | tuple[str, ...],
    split: Split = None,
    join: Join = "copy",
) -> MegatronWeight:
    """A parameter of each of `layers`: names relative to the decoder layer on both sides."""
    parts = (theirs,) if isinstance(theirs, str) else theirs
    return MegatronWeight(
        "decoder.layers.{layer}." + ours,
        tuple("model.layers.{layer}." + p for p in parts),
        join=join,
        split=split,
        layers=tuple(layers),
    )


def attention_weights(layers: Sequence[int], *, qk_norm: bool) -> list[MegatronWeight]:
    """Pre-norm GQA attention without biases: input norm, fused QKV, output projection, per-head
    q/k norms."""
    qkv = tuple(f"self_attn.{p}_proj.weight" for p in "qkv")
    out = [
        _in_layers(layers, "input_layernorm.weight", "input_layernorm.weight"),
        _in_layers(layers, "self_attention.linear_qkv.weight", qkv, "column", "qkv"),
        _in_layers(layers, "self_attention.linear_proj.weight", "self_attn.o_proj.weight", "row"),
    ]
    if qk_norm:
        out += [
            _in_layers(layers, "self_attention.q_layernorm.weight", "self_attn.q_norm.weight"),
            _in_layers(layers, "self_attention.k_layernorm.weight", "self_attn.k_norm.weight"),
        ]
    return out


def _swiglu(layers: Sequence[int], ours: str, theirs: str) -> list[MegatronWeight]:
    """A SwiGLU MLP from separate gate, up and down projections (`ours` / `theirs`: the module)."""
    gate_up = (f"{theirs}.gate_proj.weight", f"{theirs}.up_proj.weight")
    return [
        _in_layers(layers, f"{ours}.linear_fc1.weight", gate_up, "column", "gate_up"),
        _in_layers(layers, f"{ours}.linear_fc2.weight", f"{theirs}.down_proj.weight", "row"),
    ]


def _pre_mlp_norm(layers: Sequence[int]) -> MegatronWeight:
    return _in_layers(layers, "pre_mlp_layernorm.weight", "post_attention_layernorm.weight")


def swiglu_weights(layers: Sequence[int]) -> list[MegatronWeight]:
    """A dense SwiGLU MLP after its pre-MLP norm."""
    return [_pre_mlp_norm(layers), *_swiglu(layers, "mlp", "mlp")]


def routed_experts_weights(layers: Sequence[int]) -> list[MegatronWeight]:
    """A routed-expert MLP as transformers 5 holds it: a linear router (`mlp.gate`) and the
    experts stacked in two tensors (`gate_up_proj` [experts, 2 x ffn, hidden], gate rows first;
    `down_proj` [experts, hidden, ffn]). Megatron holds one module per expert."""
    experts = "mlp.experts.local_experts.{expert}."
    return [
        _pre_mlp_norm(layers),
        _in_layers(layers, "mlp.router.weight", "mlp.gate.weight"),
        _in_layers(
            layers, experts + "linear_fc1.weight", "mlp.experts.gate_up_proj", "column", "gate_up"
        ),
        _in_layers(layers, experts + "linear_fc2.weight", "mlp.experts.down_proj", "row"),
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
    attn = "self_attention."
    out = [
        _in_layers(layers, "input_layernorm.weight", "input_layernorm.weight"),
        _in_layers(
            layers,
            attn + "linear_kv_down_proj.weight",
            "self_attn.kv_a_proj_with_mqa.weight",
            "column",
        ),
        _in_layers(layers, attn + "kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
        _in_layers(
            layers, attn + "linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight", "column"
        ),
        _in_layers(layers, attn + "linear_proj.weight", "self_attn.o_proj.weight", "row"),
    ]
    if q_lora:
        out += [
            _in_layers(
                layers, attn + "linear_q_down_proj.weight", "self_attn.q_a_proj.weight", "column"
            ),
            _in_layers(layers, attn + "q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
            _in_layers(
                layers, attn + "linear_q_up_proj.weight", "self_attn.q_b_proj.weight", "column"
            ),
        ]
    else:
        out.append(
            _in_layers(layers, attn + "linear_q_proj.weight", "self_attn.q_proj.weight", "column")
        )
    return out


def shared_experts_weights(layers: Sequence[int]) -> list[MegatronWeight]:
    """Shared experts beside routed ones (one SwiGLU MLP of all shared experts' width), and the
    router's expert bias (DeepSeek-V3's `e_score_correction_bias`)."""
    return [
        _in_layers(layers, "mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
        *_swiglu(layers, "mlp.shared_experts", "mlp.shared_experts"),
    ]
