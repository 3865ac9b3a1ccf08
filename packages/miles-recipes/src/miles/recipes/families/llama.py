"""Llama (and the models built on its architecture: SmolLM2, TinyLlama, Llama 2/3): GQA attention
with rotary embeddings, SwiGLU MLPs, RMSNorms; a plain causal LM (`LlamaForCausalLM`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.core.contracts.family import (
    Config,
    MegatronMapping,
    ModelFamily,
    ModelShape,
    ParallelHints,
    ParamCounts,
)
from miles.recipes.families.megatron_maps import attention_weights, outer_weights, swiglu_weights
from miles.recipes.families.qwen3 import quantization_notices, rope_theta, with_defaults
from miles.recipes.families.sizing import embeddings, linear, rms_norm_act, swiglu, swiglu_act

# Defaults of transformers' LlamaConfig for the fields `shape` reads.
LLAMA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # None: as many as the attention heads
    "head_dim": None,  # None: hidden / heads
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}


def _heads(c: Mapping[str, Any]) -> tuple[int, int, int]:
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    return heads, int(c["num_key_value_heads"] or heads), int(c["head_dim"] or hidden // heads)


def llama_attention_act(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Per token: the projections' input, q/k after rope and v (kept by attention), the attention
    output and the output projection's result. Qwen3's measured estimate without its per-head
    q/k norms, whose inputs Llama does not have."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return hidden + (q + 2 * kv) + q + hidden


def llama_shape(config: Config) -> ModelShape:
    c = with_defaults(config, LLAMA_DEFAULTS)
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads, kv_heads, head_dim = _heads(c)
    inter, bias = int(c["intermediate_size"]), bool(c["attention_bias"])
    attention = (
        linear(hidden, heads * head_dim, bias)
        + 2 * linear(hidden, kv_heads * head_dim, bias)
        + linear(heads * head_dim, hidden, bias)
    )
    per_layer = attention + swiglu(hidden, inter, bool(c["mlp_bias"])) + 2 * hidden
    embed, head = embeddings(c)
    act = (
        2 * rms_norm_act(hidden)
        + llama_attention_act(hidden, heads, kv_heads, head_dim)
        + swiglu_act(hidden, inter)
    )
    return ModelShape(
        params=ParamCounts(embedding=embed, lm_head=head, layers=layers * per_layer, other=hidden),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=int(c["vocab_size"]),
        active_expert_params=0,
        kv_elems_per_token=layers * 2 * kv_heads * head_dim,
        state_elems_per_seq=0,
        act_elems_per_token=layers * act,
    )


def llama_parallel(config: Config) -> ParallelHints:
    c = with_defaults(config, LLAMA_DEFAULTS)
    heads, kv_heads, _ = _heads(c)
    return ParallelHints(
        tensor_divides=(
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
            ("intermediate_size", int(c["intermediate_size"])),
        )
    )


def llama_megatron(config: Config) -> MegatronMapping:
    """Megatron-core's GPTModel of a Llama: Qwen3's decoder layer without the per-head q/k norms."""
    c = with_defaults(config, LLAMA_DEFAULTS)
    heads, kv_heads, head_dim = _heads(c)
    theta, unsupported = rope_theta(c, 10_000.0)
    if c["attention_bias"] or c["mlp_bias"]:
        unsupported.append("linear biases (attention_bias, mlp_bias)")
    layers = range(int(c["num_hidden_layers"]))
    transformer = {
        "num_layers": len(layers),
        "hidden_size": int(c["hidden_size"]),
        "num_attention_heads": heads,
        "num_query_groups": kv_heads,
        "kv_channels": head_dim,
        "ffn_hidden_size": int(c["intermediate_size"]),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        "gated_linear_unit": True,
        "activation": "silu",
        "add_bias_linear": False,
        "qk_layernorm": False,
    }
    model = {
        "vocab_size": int(c["vocab_size"]),
        "max_sequence_length": int(c.get("max_position_embeddings", 2048)),
        "rotary_base": theta,
        "share_embeddings_and_output_weights": bool(c["tie_word_embeddings"]),
        "position_embedding_type": "rope",
    }
    weights = (
        outer_weights(tied=bool(c["tie_word_embeddings"]))
        + attention_weights(layers, qk_norm=False)
        + swiglu_weights(layers)
    )
    return MegatronMapping(tuple(weights), transformer, model, unsupported=tuple(unsupported))


def llama_tiny() -> dict[str, Any]:
    # SmolLM2's proportions (GQA 3:1, tied embeddings), scaled down.
    return {
        "model_type": "llama",
        "hidden_size": 96,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "initializer_range": 0.1,
    }


def llama() -> ModelFamily:
    return ModelFamily(
        "llama",
        model_types=("llama",),
        shape=llama_shape,
        parallel=llama_parallel,
        notices=quantization_notices,
        tiny=llama_tiny,
        packed_sequences=True,
        rms_norms=("LlamaRMSNorm",),
        summary="Llama: GQA with rotary embeddings, SwiGLU MLP (SmolLM2, TinyLlama, Llama 2/3)",
        checkpoints=("HuggingFaceTB/SmolLM2-135M-Instruct",),
        megatron=llama_megatron,
    )
