"""Qwen3 (dense) and Qwen3-MoE: GQA attention with per-head q/k RMSNorm, SwiGLU MLPs; the MoE
variant routes with a softmax top-k router (optionally renormalised) over experts with no shared
expert. Both are plain causal LMs (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.core.contracts.family import (
    Config,
    MegatronMapping,
    ModelFamily,
    ModelShape,
    Notice,
    ParallelHints,
    ParamCounts,
)
from miles.recipes.families.megatron_maps import (
    attention_weights,
    outer_weights,
    routed_experts_weights,
    swiglu_weights,
)
from miles.recipes.families.routers import SoftmaxTopKRouter
from miles.recipes.families.sizing import (
    embeddings,
    linear,
    moe_act,
    rms_norm_act,
    swiglu,
    swiglu_act,
)

# Defaults of transformers' Qwen3Config / Qwen3MoeConfig for the fields `shape` reads, so a
# config.json that leaves them out sizes like the model transformers builds from it.
QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,  # None: as many as the attention heads
    "head_dim": 128,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
}
QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": None,  # not a Qwen3MoeConfig field: the attention uses hidden / heads then
    "attention_bias": False,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": False,
    "mlp_only_layers": [],
}


def with_defaults(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """`config` with transformers' defaults filled in where a field is absent."""
    return {**defaults, **config}


def gqa_params(c: Mapping[str, Any], heads: int, kv_heads: int, head_dim: int) -> int:
    """q/k/v/o projections and the per-head q/k RMSNorms of a Qwen3 attention block."""
    hidden, bias = int(c["hidden_size"]), bool(c["attention_bias"])
    return (
        linear(hidden, heads * head_dim, bias)
        + 2 * linear(hidden, kv_heads * head_dim, bias)
        + linear(heads * head_dim, hidden, bias)
        + 2 * head_dim
    )


def gqa_act(hidden: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Per token: the projections' input, the q/k/v outputs (q/k's are what their fused
    per-head RMSNorm keeps), q/k after norm and rope (kept by attention), the attention output
    and the output projection's result. Measured on an H200 (`tools/bench/train_step.py`):
    rope keeps nothing per token of its own."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return hidden + (q + 2 * kv) + (q + kv) + q + hidden


def quantization_notices(config: Config) -> list[Notice]:
    """A pre-quantized checkpoint: fp8 blocks load dequantized (`load_causal_lm`); any other
    format would stay in transformers' quantized modules, whose weights are not trainable
    parameters and not what Miles syncs, so training would silently leave them frozen."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("dequantize"):
        return []
    method = quant.get("quant_method", "unknown")
    if method == "fp8":
        return [
            Notice(
                "fp8 checkpoint: loaded dequantized to the training dtype (transformers "
                "FineGrainedFP8Config(dequantize=True)); Miles trains and syncs high-precision "
                "weights (its `precision` setting can quantize the rollout engines again)"
            )
        ]
    return [
        Notice(
            f"pre-quantized checkpoint (quantization_config.quant_method={method!r}): Miles "
            "trains and syncs full-precision weights and cannot train transformers' quantized "
            "modules; use the bf16 checkpoint (Miles' `precision` setting quantizes the rollout "
            "engines itself), or set quantization_config.dequantize: true to load it as bf16",
            fatal=True,
        )
    ]


def aux_loss_notices(config: Config) -> list[Notice]:
    """MoE routers: transformers adds the load-balancing loss only when asked for router logits
    with labels; Miles' losses never ask."""
    if float(config.get("router_aux_loss_coef", 0.001) or 0) <= 0:
        return []
    return [
        Notice(
            "the router load-balancing loss (router_aux_loss_coef) is not applied: RL trains "
            "the routers through the policy loss only"
        )
    ]


def _kv_and_window(
    c: Mapping[str, Any], sliding: list[bool], kv_heads: int, head_dim: int
) -> tuple[int, int]:
    """(KV elements per token over full-attention layers, elements one sequence holds in the
    sliding-window layers' caches at a full window)."""
    per_layer = 2 * kv_heads * head_dim
    full = sum(not s for s in sliding)
    window = int(c["sliding_window"] or 0)
    return full * per_layer, sum(sliding) * window * per_layer


def qwen3_shape(config: Config) -> ModelShape:
    c = with_defaults(config, QWEN3_DEFAULTS)
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv_heads = int(c["num_key_value_heads"] or heads)
    head_dim = int(c["head_dim"] or hidden // heads)
    inter = int(c["intermediate_size"])
    per_layer = gqa_params(c, heads, kv_heads, head_dim) + swiglu(hidden, inter) + 2 * hidden
    embed, head = embeddings(c)
    # Qwen3Config: with use_sliding_window, layers from max_window_layers on slide (unless
    # config.json lists layer_types itself).
    window = c["sliding_window"] if c["use_sliding_window"] else None
    types = c["layer_types"] or [
        "sliding_attention"
        if window is not None and i >= int(c["max_window_layers"])
        else "full_attention"
        for i in range(layers)
    ]
    sliding = [t == "sliding_attention" and window is not None for t in types]
    kv, state = _kv_and_window({**c, "sliding_window": window}, sliding, kv_heads, head_dim)
    # The layer's two RMSNorms, attention, the MLP.
    norms = 2 * rms_norm_act(hidden)
    act = norms + gqa_act(hidden, heads, kv_heads, head_dim) + swiglu_act(hidden, inter)
    return ModelShape(
        params=ParamCounts(embedding=embed, lm_head=head, layers=layers * per_layer, other=hidden),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=int(c["vocab_size"]),
        active_expert_params=0,
        kv_elems_per_token=kv,
        state_elems_per_seq=state,
        act_elems_per_token=layers * act,
    )


def _is_moe_layer(c: Mapping[str, Any], index: int) -> bool:
    """Qwen3MoeDecoderLayer's rule for a sparse MLP."""
    return (
        index not in (c["mlp_only_layers"] or [])
        and int(c["num_experts"]) > 0
        and (index + 1) % int(c["decoder_sparse_step"]) == 0
    )


def _moe_fields(config: Config) -> dict[str, Any]:
    """config.json over Qwen3-MoE's defaults. transformers 5 writes the expert count as
    `num_local_experts` (its alias of `num_experts`): either name is read."""
    c = dict(with_defaults(config, QWEN3_MOE_DEFAULTS))
    text = config.get("text_config", config)
    if "num_experts" not in text and text.get("num_local_experts") is not None:
        c["num_experts"] = text["num_local_experts"]
    return c


def qwen3_moe_shape(config: Config) -> ModelShape:
    c = _moe_fields(config)
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads, kv_heads = int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    head_dim = int(c["head_dim"] or hidden // heads)
    inter, moe_inter = int(c["intermediate_size"]), int(c["moe_intermediate_size"])
    experts, top_k = int(c["num_experts"]), int(c["num_experts_per_tok"])
    attn = gqa_params(c, heads, kv_heads, head_dim) + 2 * hidden
    attn_act = 2 * rms_norm_act(hidden) + gqa_act(hidden, heads, kv_heads, head_dim)
    moe = [_is_moe_layer(c, i) for i in range(layers)]
    n_moe = sum(moe)
    dense_params = (layers - n_moe) * swiglu(hidden, inter)
    expert = swiglu(hidden, moe_inter)  # one expert's gate, up and down projections
    embed, head = embeddings(c)
    # Qwen3-MoE slides every layer when use_sliding_window is set.
    window = c["sliding_window"] if c["use_sliding_window"] else None
    kv, state = _kv_and_window(
        {**c, "sliding_window": window}, [window is not None] * layers, kv_heads, head_dim
    )
    act = layers * attn_act + sum(
        moe_act(hidden, moe_inter, top_k, experts) if m else swiglu_act(hidden, inter) for m in moe
    )
    return ModelShape(
        params=ParamCounts(
            embedding=embed,
            lm_head=head,
            layers=layers * attn + dense_params + n_moe * experts * hidden,  # + routers
            experts=n_moe * experts * expert,
            other=hidden,
        ),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=int(c["vocab_size"]),
        active_expert_params=n_moe * top_k * expert,
        kv_elems_per_token=kv,
        state_elems_per_seq=state,
        act_elems_per_token=act,
    )


def qwen3_parallel(config: Config) -> ParallelHints:
    c = with_defaults(config, QWEN3_DEFAULTS)
    heads = int(c["num_attention_heads"])
    return ParallelHints(
        tensor_divides=(
            ("num_attention_heads", heads),
            ("num_key_value_heads", int(c["num_key_value_heads"] or heads)),
            ("intermediate_size", int(c["intermediate_size"])),
        )
    )


def qwen3_moe_parallel(config: Config) -> ParallelHints:
    c = _moe_fields(config)
    return ParallelHints(
        tensor_divides=(
            ("num_attention_heads", int(c["num_attention_heads"])),
            ("num_key_value_heads", int(c["num_key_value_heads"])),
            ("moe_intermediate_size", int(c["moe_intermediate_size"])),
        ),
        expert_divides=(("num_experts", int(c["num_experts"])),),
    )


def qwen3_moe_notices(config: Config) -> list[Notice]:
    return quantization_notices(config) + aux_loss_notices(config)


def rope_theta(c: Mapping[str, Any], default: float) -> tuple[float, list[str]]:
    """The RoPE base from a config.json of either transformers generation, and what Megatron's
    plain RoPE cannot express (scaled RoPE types)."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    theta = float(params.get("rope_theta") or c.get("rope_theta") or default)
    kind = params.get("rope_type") or params.get("type") or "default"
    return theta, [] if kind == "default" else [f"RoPE type {kind!r} (rope_parameters)"]


def _gqa_transformer(c: Mapping[str, Any]) -> dict[str, Any]:
    """TransformerConfig fields of Qwen3's decoder layer, whatever its MLP."""
    heads = int(c["num_attention_heads"])
    return {
        "num_layers": int(c["num_hidden_layers"]),
        "hidden_size": int(c["hidden_size"]),
        "num_attention_heads": heads,
        "num_query_groups": int(c["num_key_value_heads"] or heads),
        "kv_channels": int(c["head_dim"] or int(c["hidden_size"]) // heads),
        "ffn_hidden_size": int(c["intermediate_size"]),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        "gated_linear_unit": True,
        "activation": "silu",
        "add_bias_linear": False,
        "qk_layernorm": True,
    }


def _gpt_model(c: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    theta, unsupported = rope_theta(c, 10_000.0)  # transformers 5 default
    if c["use_sliding_window"]:
        unsupported.append("sliding-window attention (use_sliding_window)")
    if c["attention_bias"]:
        # Qwen3 puts a bias on o_proj too; Megatron has biases on every linear or on QKV only.
        unsupported.append("attention biases (attention_bias)")
    model = {
        "vocab_size": int(c["vocab_size"]),
        "max_sequence_length": int(c.get("max_position_embeddings", 40960)),
        "rotary_base": theta,
        "share_embeddings_and_output_weights": bool(c["tie_word_embeddings"]),
        "position_embedding_type": "rope",
    }
    return model, unsupported


def qwen3_megatron(config: Config) -> MegatronMapping:
    c = with_defaults(config, QWEN3_DEFAULTS)
    layers = range(int(c["num_hidden_layers"]))
    model, unsupported = _gpt_model(c)
    weights = (
        outer_weights(tied=bool(c["tie_word_embeddings"]))
        + attention_weights(layers, qk_norm=True)
        + swiglu_weights(layers)
    )
    return MegatronMapping(
        tuple(weights), _gqa_transformer(c), model, unsupported=tuple(unsupported)
    )


def qwen3_moe_megatron(config: Config) -> MegatronMapping:
    c = _moe_fields(config)
    n = int(c["num_hidden_layers"])
    moe = [i for i in range(n) if _is_moe_layer(c, i)]
    dense = [i for i in range(n) if i not in moe]
    model, unsupported = _gpt_model(c)
    transformer = {
        **_gqa_transformer(c),
        "num_moe_experts": int(c["num_experts"]),
        "moe_router_topk": int(c["num_experts_per_tok"]),
        "moe_ffn_hidden_size": int(c["moe_intermediate_size"]),
        "moe_layer_freq": [int(i in moe) for i in range(n)],
        # Softmax over every expert then top-k; renormalising the top-k (norm_topk_prob) is the
        # same as a softmax over the top-k logits, which is Megatron's order without pre-softmax.
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not bool(c["norm_topk_prob"]),
        # RL trains the routers through the policy loss only (see aux_loss_notices).
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
    }
    weights = (
        outer_weights(tied=bool(c["tie_word_embeddings"]))
        + attention_weights(range(n), qk_norm=True)
        + swiglu_weights(dense)
        + routed_experts_weights(moe)
    )
    return MegatronMapping(
        tuple(weights),
        transformer,
        model,
        num_experts=int(c["num_experts"]),
        unsupported=tuple(unsupported),
    )


def qwen3_tiny() -> dict[str, Any]:
    # The quickstart recipe relies on these exact values.
    return {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
        "initializer_range": 0.1,
    }


def qwen3_moe_tiny() -> dict[str, Any]:
    # The quickstart recipe relies on these exact values: 4 experts, top-2, every layer MoE.
    return {
        **qwen3_tiny(),
        "model_type": "qwen3_moe",
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def qwen3() -> ModelFamily:
    return ModelFamily(
        "qwen3",
        model_types=("qwen3",),
        shape=qwen3_shape,
        parallel=qwen3_parallel,
        notices=quantization_notices,
        tiny=qwen3_tiny,
        packed_sequences=True,
        rms_norms=("Qwen3RMSNorm",),
        compile_layers=True,
        summary="Qwen3 dense: GQA with q/k RMSNorm, SwiGLU MLP",
        checkpoints=("Qwen/Qwen3-0.6B", "Qwen/Qwen3-4B", "Qwen/Qwen3-8B"),
        megatron=qwen3_megatron,
    )


def qwen3_moe() -> ModelFamily:
    return ModelFamily(
        "qwen3_moe",
        model_types=("qwen3_moe",),
        router=SoftmaxTopKRouter(),
        shape=qwen3_moe_shape,
        parallel=qwen3_moe_parallel,
        notices=qwen3_moe_notices,
        tiny=qwen3_moe_tiny,
        packed_sequences=True,
        rms_norms=("Qwen3MoeRMSNorm",),
        summary="Qwen3-MoE: GQA with q/k RMSNorm, softmax top-k routed experts",
        checkpoints=("Qwen/Qwen3-30B-A3B",),
        megatron=qwen3_moe_megatron,
    )
