"""DeepSeek-V3 and the models built on its architecture (Kimi K2 checkpoints load as it).

transformers' `DeepseekV3ForCausalLM`: multi-head latent attention (MLA: a low-rank query, and
keys/values expanded from one compressed latent plus a single shared rotary key, which is all
the KV cache holds), `first_k_dense_replace` dense SwiGLU layers, then MoE layers: a sigmoid
router with group-limited top-k on bias-corrected scores, routed experts and shared experts.
The Kimi K2.5 / K2.6 multimodal checkpoints wrap the same language model; `families/kimi_k25.py`
reuses the arithmetic, notices and loading here.

Everything but `load` and the router works on config dicts and imports neither torch nor
transformers.
"""

from __future__ import annotations

import importlib.util
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
    quantization_config,
    text_config,
)
from miles.recipes.families.megatron_maps import (
    mla_weights,
    outer_weights,
    routed_experts_weights,
    shared_experts_weights,
    swiglu_weights,
)
from miles.recipes.families.sizing import linear, moe_act, swiglu, swiglu_act

# DeepseekV3Config's defaults (transformers 5.x) for the fields read here, so a config.json that
# leaves one out sizes like the model transformers builds from it.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "attention_bias": False,
    "tie_word_embeddings": False,
}


def _dims(config: Config) -> dict[str, Any]:
    """The fields read here, transformers' defaults filling the absent ones (an explicit null,
    e.g. `q_lora_rank: null` for a full-rank query, is kept)."""
    return {name: config.get(name, default) for name, default in DEFAULTS.items()}


def mla_params(c: Mapping[str, Any]) -> int:
    """One MLA block: the query (low-rank with its RMSNorm, or full rank), the KV latent and
    rotary key projection, the latent's RMSNorm, the K/V expansion, and the output."""
    hidden, heads, bias = int(c["hidden_size"]), int(c["num_attention_heads"]), c["attention_bias"]
    nope, rope, v_dim = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    kv_rank, q_rank = int(c["kv_lora_rank"]), c["q_lora_rank"]
    q_out = heads * (nope + rope)
    if q_rank is None:
        query = linear(hidden, q_out)
    else:
        query = linear(hidden, int(q_rank), bool(bias)) + int(q_rank) + linear(int(q_rank), q_out)
    kv = (
        linear(hidden, kv_rank + rope, bool(bias))
        + kv_rank
        + linear(kv_rank, heads * (nope + v_dim))
    )
    return query + kv + linear(heads * v_dim, hidden, bool(bias))


def mla_act(c: Mapping[str, Any]) -> int:
    """Per token: the block's input, the query path (latent, its norm, the heads), the KV latent
    and its norm, the expanded K/V, the attention output and the output projection's result."""
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    nope, rope, v_dim = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    kv_rank, q_rank = int(c["kv_lora_rank"]), c["q_lora_rank"]
    query = (2 * int(q_rank) if q_rank is not None else 0) + heads * (nope + rope)
    kv = (kv_rank + rope) + kv_rank + heads * (nope + v_dim)
    return hidden + query + kv + heads * v_dim + hidden


def text_shape(text: Config, *, tied: bool | None = None, vision: int = 0) -> ModelShape:
    """The DeepSeek-V3 language model of `text` (a DeepseekV3Config dict). `tied` overrides the
    config's tie_word_embeddings (a multimodal wrapper decides it); `vision` is the wrapper's
    vision tower and projector."""
    c = _dims(text)
    hidden, vocab, num_layers = (
        int(c["hidden_size"]),
        int(c["vocab_size"]),
        int(c["num_hidden_layers"]),
    )
    experts, top_k = int(c["n_routed_experts"]), int(c["num_experts_per_tok"])
    moe_inter, shared = int(c["moe_intermediate_size"]), int(c["n_shared_experts"])
    dense = min(int(c["first_k_dense_replace"]), num_layers)
    moe = num_layers - dense
    tied = bool(c["tie_word_embeddings"]) if tied is None else tied

    norms = 2 * hidden  # input and post-attention RMSNorms
    # A MoE layer outside its routed experts: the router's weight (its score-correction bias is
    # a buffer) and the shared experts, one SwiGLU of n_shared_experts times the expert width.
    moe_dense = experts * hidden + swiglu(hidden, moe_inter * shared)
    layers = (
        num_layers * (mla_params(c) + norms)
        + dense * swiglu(hidden, int(c["intermediate_size"]))
        + moe * moe_dense
    )
    expert_params = 3 * hidden * moe_inter  # gate, up and down of one routed expert
    params = ParamCounts(
        embedding=vocab * hidden,
        lm_head=0 if tied else vocab * hidden,
        layers=layers,
        experts=moe * experts * expert_params,
        other=hidden,  # the final RMSNorm
        vision=vision,
    )
    act = num_layers * (mla_act(c) + hidden) + dense * swiglu_act(
        hidden, int(c["intermediate_size"])
    )
    act += moe * (
        moe_act(hidden, moe_inter, top_k, experts) + swiglu_act(hidden, moe_inter * shared)
    )
    return ModelShape(
        params=params,
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        active_expert_params=moe * top_k * expert_params,
        # MLA caches the normed KV latent and the shared rotary key per layer, not per-head K/V.
        kv_elems_per_token=num_layers * (int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"])),
        state_elems_per_seq=0,  # full attention everywhere: nothing fixed-size per sequence
        act_elems_per_token=act,
    )


def shape(config: Config) -> ModelShape:
    return text_shape(config)


def text_parallel(text: Config) -> ParallelHints:
    """MLA shards by attention head (q/kv expansions column-wise, o_proj row-wise)."""
    c = _dims(text)
    return ParallelHints(
        tensor_divides=(("num_attention_heads", int(c["num_attention_heads"])),),
        expert_divides=(("n_routed_experts", int(c["n_routed_experts"])),),
    )


def parallel(config: Config) -> ParallelHints:
    return text_parallel(config)


def mtp_notices(text: Config) -> list[Notice]:
    """Multi-token-prediction layers: transformers' DeepseekV3ForCausalLM builds none; their
    weights (the layers after the last decoder layer) are skipped as unexpected at load. Only
    `generate(use_mtp=True)` reads them, into a separate draft model Miles does not use. An absent
    field counts as none: it describes what the checkpoint holds."""
    layers = int(text.get("num_nextn_predict_layers", text.get("num_mtp_layers", 0)) or 0)
    if layers <= 0:
        return []
    return [
        Notice(
            f"the checkpoint's {layers} multi-token-prediction (MTP) layer(s) "
            f"(num_nextn_predict_layers={layers}) are not loaded: transformers' "
            "DeepseekV3ForCausalLM does not build them, so Miles neither trains them nor syncs "
            "them, and checkpoints it saves carry no MTP weights (engines cannot use them for "
            "MTP speculative decoding)"
        )
    ]


def router_notices(text: Config) -> list[Notice]:
    """transformers' router always scores with a sigmoid, picks group-limited top-k on
    bias-corrected scores (DeepSeek's `noaux_tc`) and makes every layer from
    first_k_dense_replace on a MoE layer, whatever the config says: a config asking for
    anything else would silently train a different model."""
    wanted = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    out = [
        Notice(
            f"{name}={text[name]!r} is not supported: transformers' DeepSeek-V3 router implements "
            f"only {name}={value!r}, so it would route differently from this checkpoint",
            fatal=True,
        )
        for name, value in wanted.items()
        if name in text and text[name] != value
    ]
    if int(text.get("n_routed_experts", DEFAULTS["n_routed_experts"]) or 0) > 0:
        out.append(
            Notice(
                "expert load balancing is not trained: the routers' score-correction bias "
                "(e_score_correction_bias, a buffer) keeps its checkpoint values and no auxiliary "
                "balance loss is added; RL trains the routers through the policy loss only"
            )
        )
    return out


def _int4_scheme(quant: Mapping[str, Any]) -> str:
    """'4-bit int, group size 32, symmetric' from a compressed-tensors config's first weight
    group."""
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights:
            sym = "symmetric" if weights.get("symmetric") else "asymmetric"
            return (
                f"{weights.get('num_bits')}-bit {weights.get('type')}, "
                f"{weights.get('strategy')} size {weights.get('group_size')}, {sym}"
            )
    return "unknown scheme"


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def quantization_notices(config: Config) -> list[Notice]:
    """What loading does with a pre-quantized checkpoint. fp8 (DeepSeek-V3, Kimi K2): transformers
    dequantizes it at load, which `load_causal_lm` asks for (on a GPU of compute capability >= 8.9 it would
    otherwise keep untrainable fp8 linears). compressed-tensors INT4 (Kimi K2-Thinking, K2.5,
    K2.6 routed experts): transformers can dequantize it only through the compressed-tensors
    package."""
    quant = quantization_config(config)
    if quant is None or quant.get("dequantize"):
        return []
    method = str(quant.get("quant_method", "unknown"))
    if method == "fp8":
        block = quant.get("weight_block_size")
        return [
            Notice(
                f"fp8 checkpoint ({quant.get('fmt', 'e4m3')}, block scales {block}): loaded "
                "dequantized to the training dtype (transformers FineGrainedFP8Config("
                "dequantize=True)); Miles trains and syncs high-precision weights (its `precision` "
                "setting can quantize the rollout engines again)"
            )
        ]
    if method == "compressed-tensors":
        what = f"{quant.get('format', 'compressed')} {_int4_scheme(quant)}"
        if not installed("compressed_tensors"):
            return [
                Notice(
                    f"compressed-tensors checkpoint ({what}; Kimi's releases quantize the routed experts): "
                    "transformers loads it only through the compressed-tensors package "
                    "(>= 0.15), which is not installed, so loading fails. Install it, or use a "
                    "checkpoint with the experts dequantized to bf16",
                    fatal=True,
                )
            ]
        return [
            Notice(
                f"compressed-tensors checkpoint ({what}): the quantized weights are loaded "
                "dequantized to the training dtype (transformers CompressedTensorsConfig("
                "dequantize=True)); Miles trains and syncs them in high precision, off the "
                "quantization grid (this path is not covered by Miles' tests)"
            )
        ]
    return [
        Notice(
            f"pre-quantized checkpoint (quant_method={method!r}): Miles does not "
            "dequantize it, and transformers' quantized modules are not trainable; use a bf16 "
            "checkpoint",
            fatal=True,
        )
    ]


def text_notices(text: Config) -> list[Notice]:
    return router_notices(text) + mtp_notices(text)


def notices(config: Config) -> list[Notice]:
    return quantization_notices(config) + text_notices(config)


def load_text_model(
    path: str, config: Any, key_mapping: dict[str, str] | None, **kwargs: Any
) -> Any:
    """DeepseekV3ForCausalLM from `path` with the given DeepseekV3Config, renaming checkpoint keys
    by `key_mapping` (`load_causal_lm` has asked for a quantized checkpoint's dequantization). Fails when any of the model's weights is not in the
    checkpoint (transformers would otherwise leave it randomly initialised, with a warning)."""
    from transformers import AutoModelForCausalLM

    if key_mapping:
        kwargs["key_mapping"] = {**key_mapping, **(kwargs.get("key_mapping") or {})}
    want_info = bool(kwargs.pop("output_loading_info", False))
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path, config=config, output_loading_info=True, **kwargs
    )
    model, info = loaded
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{path}: {len(missing)} weight(s) of the {type(model).__name__} are not in the "
            f"checkpoint, e.g. {missing[:3]}"
        )
    if key_mapping:
        _forget_renamings(model, set(key_mapping))
    return (model, info) if want_info else model


def _forget_renamings(model: Any, sources: set[str]) -> None:
    """transformers keeps the renamings a model was loaded with and reverses them in
    save_pretrained; ours would write the causal LM back under the wrapper's names, which the
    causal LM's own type does not load. Its own conversions (the experts' fusing) stay."""
    from transformers.core_model_loading import WeightRenaming

    kept = getattr(model, "_weight_conversions", None)
    if kept is not None:
        model._weight_conversions = [
            c
            for c in kept
            if not (isinstance(c, WeightRenaming) and set(c.source_patterns) <= sources)
        ]


def load(path: str, **kwargs: Any) -> Any:
    """AutoModelForCausalLM, except that a Kimi K2 config.json (model_type kimi_k2, which
    transformers only knows through the checkpoint's remote code) is read as a DeepseekV3Config,
    and a pre-quantized checkpoint is dequantized."""
    from transformers import AutoConfig, PreTrainedConfig

    config = kwargs.pop("config", None)
    if config is None:
        raw, _ = PreTrainedConfig.get_config_dict(path)
        # The remote-code pointers would ask for trust_remote_code; the architecture is ours.
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
        config = AutoConfig.for_model("deepseek_v3", **fields)
    return load_text_model(path, config, None, **kwargs)


def _yarn(text: Config) -> tuple[dict[str, Any], list[str]]:
    """MLATransformerConfig's RoPE fields, and a RoPE type it cannot express."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    theta = float(rope.get("rope_theta") or text.get("rope_theta") or 10000.0)
    if kind == "default":
        return {"rope_type": "rope", "rotary_base": theta}, []
    if kind != "yarn":
        return {"rope_type": "rope", "rotary_base": theta}, [f"RoPE type {kind!r}"]
    return {
        "rope_type": "yarn",
        "rotary_base": theta,
        "rotary_scaling_factor": float(rope["factor"]),
        "original_max_position_embeddings": int(rope["original_max_position_embeddings"]),
        "beta_fast": float(rope.get("beta_fast", 32.0)),
        "beta_slow": float(rope.get("beta_slow", 1.0)),
        "mscale": float(rope.get("mscale", 1.0)),
        "mscale_all_dim": float(rope.get("mscale_all_dim", 0.0)),
    }, []


def megatron(config: Config) -> MegatronMapping:
    """MLA, dense then MoE layers (sigmoid group-limited router with expert bias, routed and
    shared experts) as Megatron-core's MLATransformerConfig describes them."""
    text = text_config(config)
    c = _dims(text)
    n, dense = int(c["num_hidden_layers"]), int(c["first_k_dense_replace"])
    heads = int(c["num_attention_heads"])
    rope, unsupported = _yarn(text)
    if c["attention_bias"]:
        unsupported.append("attention biases (attention_bias)")
    if not text.get("norm_topk_prob", True):
        unsupported.append("top-k weights without renormalisation (norm_topk_prob: false)")
    experts, moe_inter = int(c["n_routed_experts"]), int(c["moe_intermediate_size"])
    transformer = {
        "multi_latent_attention": True,
        "num_layers": n,
        "hidden_size": int(c["hidden_size"]),
        "num_attention_heads": heads,
        "ffn_hidden_size": int(c["intermediate_size"]),
        "q_lora_rank": c["q_lora_rank"],
        "kv_lora_rank": int(c["kv_lora_rank"]),
        "qk_head_dim": int(c["qk_nope_head_dim"]),
        "qk_pos_emb_head_dim": int(c["qk_rope_head_dim"]),
        "v_head_dim": int(c["v_head_dim"]),
        "kv_channels": int(c["qk_nope_head_dim"]) + int(c["qk_rope_head_dim"]),
        **rope,
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(text.get("rms_norm_eps", 1e-6)),
        "qk_layernorm": True,  # the low-rank query's and the latent's norms
        "gated_linear_unit": True,
        "activation": "silu",
        "add_bias_linear": False,
        "num_moe_experts": experts,
        "moe_router_topk": int(c["num_experts_per_tok"]),
        "moe_ffn_hidden_size": moe_inter,
        "moe_shared_expert_intermediate_size": int(c["n_shared_experts"]) * moe_inter,
        "moe_layer_freq": [int(i >= dense) for i in range(n)],
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_num_groups": int(text.get("n_group", 8)),
        "moe_router_group_topk": int(text.get("topk_group", 4)),
        "moe_router_topk_scaling_factor": float(text.get("routed_scaling_factor", 2.5)),
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
    }
    model = {
        "vocab_size": int(c["vocab_size"]),
        "max_sequence_length": int(text.get("max_position_embeddings", 4096)),
        "rotary_base": rope["rotary_base"],
        "share_embeddings_and_output_weights": bool(c["tie_word_embeddings"]),
        # MLA applies its own rotary embedding; GPTModel adds none for it.
        "position_embedding_type": "rope",
    }
    moe = range(dense, n)
    weights = (
        outer_weights(tied=bool(c["tie_word_embeddings"]))
        + mla_weights(range(n), q_lora=c["q_lora_rank"] is not None)
        + swiglu_weights(range(dense))
        + routed_experts_weights(moe)
        + shared_experts_weights(moe)
    )
    return MegatronMapping(
        tuple(weights), transformer, model, num_experts=experts, unsupported=tuple(unsupported)
    )


def tiny() -> dict[str, Any]:
    """Three layers (one dense, two MoE) with every feature of DeepSeek-V3: low-rank query, MLA,
    group-limited routing (2 groups, 1 picked), a shared expert, YaRN rope."""
    return {
        "model_type": "deepseek_v3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        # The real checkpoint has one MTP layer, which transformers never builds: the twin has none.
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "initializer_range": 0.1,
    }


def deepseek_v3() -> ModelFamily:
    from miles.recipes.families.routers import SigmoidGroupRouter  # imports torch

    return ModelFamily(
        "deepseek_v3",
        model_types=("deepseek_v3", "kimi_k2"),
        router=SigmoidGroupRouter(),
        shape=shape,
        parallel=parallel,
        notices=notices,
        tiny=tiny,
        load=load,
        packed_sequences=True,
        rms_norms=("DeepseekV3RMSNorm",),
        summary="DeepSeek-V3 / Kimi K2: MLA attention, dense then MoE layers with a sigmoid "
        "group-limited top-k router and shared experts",
        checkpoints=("deepseek-ai/DeepSeek-V3",),
        megatron=megatron,
    )
