"""GLM-5 / GLM-5.1 (transformers `glm_moe_dsa`, `GlmMoeDsaForCausalLM`).

DeepSeek-V3.2-style decoder: MLA attention (low-rank q and compressed kv latent + a decoupled
rope key) with a DeepSeek Sparse Attention (DSA) indexer that picks, for every query, the
`index_topk` keys it may attend to; the first `first_k_dense_replace` layers have a dense SwiGLU
MLP, the rest a sigmoid, group-limited top-k MoE with shared experts (the DeepSeek-V3 router,
so routing replay reuses `SigmoidGroupRouter`: `GlmMoeDsaTopkRouter.forward` itself returns
`(logits, weights, indices)` and the MoE block only consumes them). Layers may be "shared"
indexer layers (GLM-5.2's IndexShare): they own no indexer and reuse the previous full layer's
selection. The MTP layer of the checkpoint (`model.layers.<num_hidden_layers>`) is not built by
transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.core.contracts.family import (
    Config,
    ModelFamily,
    ModelShape,
    Notice,
    ParallelHints,
    ParamCounts,
    text_config,
)
from miles.recipes.families import sizing
from miles.recipes.families.routers import SigmoidGroupRouter

# transformers' GlmMoeDsaConfig defaults, for fields a config.json may omit.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
    "num_experts_per_tok": 8,
    "attention_bias": False,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "first_k_dense_replace": 3,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


def _fields(config: Config) -> dict[str, Any]:
    """config.json fields over transformers' defaults (None means "default" there too)."""
    text = text_config(config)
    out = dict(DEFAULTS)
    out.update({k: v for k, v in text.items() if v is not None})
    # Aliases transformers accepts for the expert count.
    for alias in ("num_experts", "num_local_experts"):
        if text.get(alias) is not None:
            out["n_routed_experts"] = text[alias]
    return out


def mlp_layer_types(c: Mapping[str, Any]) -> list[str]:
    """ "dense" or "sparse" per layer, as GlmMoeDsaConfig derives it."""
    if c.get("mlp_layer_types") is not None:
        return list(c["mlp_layer_types"])
    layers = int(c["num_hidden_layers"])
    dense = min(int(c["first_k_dense_replace"]), layers)
    return ["dense"] * dense + ["sparse"] * (layers - dense)


def indexer_types(c: Mapping[str, Any]) -> list[str]:
    """ "full" (runs its own indexer) or "shared" (reuses the previous full layer's top-k) per
    layer: an explicit list, else a pattern string ("FSS..."), else the freq/offset schedule."""
    if c.get("indexer_types") is not None:
        return list(c["indexer_types"])
    pattern = c.get("index_topk_pattern")
    if pattern is not None:
        letters = {"F": "full", "S": "shared"}
        return [letters[p] for p in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(int(c.get("index_topk_freq", 1)), 1)
    offset = int(c.get("index_skip_topk_offset", 2))
    layers = int(c["num_hidden_layers"])
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


def _attention_params(c: Mapping[str, Any]) -> int:
    """MLA projections and their norms (the indexer is counted apart)."""
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    q_rank, kv_rank = int(c["q_lora_rank"]), int(c["kv_lora_rank"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    bias = bool(c["attention_bias"])
    return (
        sizing.linear(hidden, q_rank, bias)  # q_a_proj
        + q_rank  # q_a_layernorm
        + sizing.linear(q_rank, heads * (nope + rope))  # q_b_proj
        + sizing.linear(hidden, kv_rank + rope, bias)  # kv_a_proj_with_mqa
        + kv_rank  # kv_a_layernorm
        + sizing.linear(kv_rank, heads * (nope + v))  # kv_b_proj
        + sizing.linear(heads * v, hidden, bias)  # o_proj
    )


def indexer_params(c: Mapping[str, Any]) -> int:
    """One DSA indexer: wq_b, wk, k_norm (a LayerNorm: weight and bias), weights_proj."""
    hidden, q_rank = int(c["hidden_size"]), int(c["q_lora_rank"])
    heads, dim = int(c["index_n_heads"]), int(c["index_head_dim"])
    return (
        sizing.linear(q_rank, heads * dim)
        + sizing.linear(hidden, dim)
        + 2 * dim
        + sizing.linear(hidden, heads)
    )


def _attention_act(c: Mapping[str, Any]) -> int:
    """Per token, what MLA keeps for backward: the norm input, each projection's output, the
    attention output. The indexer runs under no_grad in transformers and keeps nothing."""
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    q_rank, kv_rank = int(c["q_lora_rank"]), int(c["kv_lora_rank"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    return (
        hidden  # input_layernorm input
        + 2 * q_rank  # q_a_proj out, q_a_layernorm out
        + heads * (nope + rope)  # q_b_proj out
        + (kv_rank + rope)
        + kv_rank  # kv_a_proj out, kv_a_layernorm out
        + heads * (nope + v)  # kv_b_proj out
        + heads * v  # attention output (o_proj input)
        + hidden  # o_proj out
    )


def shape(config: Config) -> ModelShape:
    c = _fields(config)
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    experts, top_k = int(c["n_routed_experts"]), int(c["num_experts_per_tok"])
    moe_inter, inter = int(c["moe_intermediate_size"]), int(c["intermediate_size"])
    shared_inter = moe_inter * int(c["n_shared_experts"])
    mlps, indexers = mlp_layer_types(c), indexer_types(c)

    embedding, lm_head = sizing.embeddings(c)
    layer_params = expert_params = act = 0
    moe_layers = full_indexers = 0
    for i in range(layers):
        layer_params += _attention_params(c) + 2 * hidden  # + input / post-attention norms
        act += _attention_act(c) + hidden  # + post-attention norm input
        if indexers[i] == "full":
            layer_params += indexer_params(c)
            full_indexers += 1
        if mlps[i] == "sparse":
            moe_layers += 1
            # Router weight (its e_score_correction_bias is a buffer) and the shared experts.
            layer_params += experts * hidden + sizing.swiglu(hidden, shared_inter)
            expert_params += experts * sizing.swiglu(hidden, moe_inter)
            act += sizing.moe_act(hidden, moe_inter, top_k, experts)
            act += sizing.swiglu_act(hidden, shared_inter)
        else:
            layer_params += sizing.swiglu(hidden, inter)
            act += sizing.swiglu_act(hidden, inter)

    # The cache holds, per layer and token, the compressed kv latent and the rope key (MLA), and
    # on "full" indexer layers the indexer's key. Nothing is fixed-size per sequence.
    kv = layers * (int(c["kv_lora_rank"]) + int(c["qk_rope_head_dim"]))
    kv += full_indexers * int(c["index_head_dim"])
    return ModelShape(
        params=ParamCounts(
            embedding=embedding,
            lm_head=lm_head,
            layers=layer_params,
            experts=expert_params,
            other=hidden,  # final norm
        ),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=int(c["vocab_size"]),
        active_expert_params=moe_layers * top_k * sizing.swiglu(hidden, moe_inter),
        kv_elems_per_token=kv,
        state_elems_per_seq=0,
        act_elems_per_token=act,
    )


def parallel(config: Config) -> ParallelHints:
    c = _fields(config)
    # transformers' TP plan shards attention by head and the MLPs by their intermediate width;
    # the indexer is not sharded.
    return ParallelHints(
        tensor_divides=(
            ("num_attention_heads", int(c["num_attention_heads"])),
            ("num_key_value_heads", int(c["num_key_value_heads"])),
            ("intermediate_size", int(c["intermediate_size"])),
            ("moe_intermediate_size", int(c["moe_intermediate_size"])),
        ),
        expert_divides=(("n_routed_experts", int(c["n_routed_experts"])),),
    )


def _quantization_notices(quant: Mapping[str, Any]) -> list[Notice]:
    method = str(quant.get("quant_method", ""))
    if method == "fp8" and quant.get("weight_block_size") is not None:
        return [
            Notice(
                f"FP8 checkpoint (quant_method fp8, e4m3 blocks of "
                f"{quant.get('weight_block_size')}): Miles loads it dequantized to the "
                "training dtype (transformers FineGrainedFP8Config(dequantize=True), which "
                "load_causal_lm asks for), trains and syncs it in that dtype, and saves it "
                "unquantized; use precision=fp8 to give the engines fp8 weights again."
            )
        ]
    return [
        Notice(
            f"quantization_config with quant_method {method!r}: Miles trains from unquantized "
            "or block-FP8 GLM-5 checkpoints only; load the BF16 checkpoint (e.g. zai-org/GLM-5 "
            "or zai-org/GLM-5.1) instead.",
            fatal=True,
        )
    ]


def notices(config: Config) -> list[Notice]:
    c = _fields(config)
    out: list[Notice] = []
    mtp = int(c.get("num_nextn_predict_layers") or 0)
    if mtp > 0:
        first = int(c["num_hidden_layers"])
        out.append(
            Notice(
                f"{mtp} MTP layer(s) (num_nextn_predict_layers; checkpoint layers "
                f"model.layers.{first}+): transformers' GlmMoeDsaForCausalLM does not build "
                "them, so their weights are skipped at load, RL does not train them, and "
                "checkpoints Miles saves do not contain them (MTP speculative decoding needs the "
                "original MTP weights)."
            )
        )
    full = indexer_types(c).count("full")
    if full:
        topk = int(c["index_topk"])
        out.append(
            Notice(
                f"DSA indexer ({full} layers, {indexer_params(c) * full:,} parameters): "
                f"inference uses transformers' top-{topk} token selection as-is (sequences up to "
                f"{topk} tokens attend densely). Training: transformers runs the indexer under "
                "torch.no_grad and its top-k mask is not differentiable, so the indexer gets no "
                "gradient and stays frozen at the checkpoint's weights; its own training "
                "objective (the KL to the main attention's distribution) is not implemented by "
                "Miles. Routing replay covers the MoE experts, not this selection: past "
                f"{topk} tokens the trainer recomputes it and may pick other keys than the "
                "rollout engine did."
            )
        )
    # Fields GlmMoeDsaForCausalLM reads as fixed: a config that says otherwise is another model.
    fixed = {
        "scoring_func": ("sigmoid",),
        "topk_method": ("noaux_tc",),
        "moe_layer_freq": (1,),
        "rope_interleave": (True,),
        "indexer_rope_interleave": (True,),
    }
    for name, allowed in fixed.items():
        if name in c and c[name] not in allowed:
            out.append(
                Notice(
                    f"{name}={c[name]!r}: transformers' GlmMoeDsaForCausalLM always uses "
                    f"{allowed[0]!r}; loading it would run a different model.",
                    fatal=True,
                )
            )
    quant = text_config(config).get("quantization_config") or config.get("quantization_config")
    if isinstance(quant, Mapping):
        out.extend(_quantization_notices(quant))
    return out


def tiny() -> dict[str, Any]:
    """3 layers: one dense, two MoE (8 experts, top-2, a shared expert), every layer with its DSA
    indexer (GLM-5 / 5.1 run one on every layer) selecting 8 keys, fewer than a 32-token
    sequence, so the sparse mask is exercised."""
    return {
        "model_type": "glm_moe_dsa",
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
        # Enough indexer heads that key scores do not tie: transformers breaks top-k ties by
        # position, which differs between a cached decode and a full forward.
        "index_n_heads": 16,
        "index_head_dim": 16,
        "index_topk": 8,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


def glm_moe_dsa() -> ModelFamily:
    return ModelFamily(
        "glm_moe_dsa",
        megatron_missing=(
            "DeepSeek Sparse Attention's lightning indexer (each query attends only to "
            "the index_topk keys it selects), which megatron-core's local layer spec "
            "has no module for; its MLA, dense and MoE layers alone would be "
            "expressible"
        ),
        model_types=("glm_moe_dsa",),
        router=SigmoidGroupRouter(),
        shape=shape,
        parallel=parallel,
        notices=notices,
        tiny=tiny,
        summary="GLM-5 / GLM-5.1: MLA + DSA sparse-attention indexer, sigmoid group-limited "
        "top-k MoE after 3 dense layers",
        checkpoints=("zai-org/GLM-5", "zai-org/GLM-5.1"),
    )
