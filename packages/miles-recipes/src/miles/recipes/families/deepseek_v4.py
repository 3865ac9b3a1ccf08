"""DeepSeek-V4 (transformers `deepseek_v4`, `DeepseekV4ForCausalLM`): DeepSeek-V4-Flash and -Pro.

Every decoder layer carries `hc_mult` residual streams (manifold-constrained hyper-connections:
each block reads a learned mix of the streams and writes back through a Sinkhorn-projected
mixing matrix) and is a mixture of experts; no layer is dense.

- Attention is shared-KV multi-query attention (one 512-wide head that is both key and value)
  with a low-rank query, per-head attention sinks, partial RoPE, a 128-token sliding window on
  every layer and a grouped low-rank output projection. On top of the window, a layer may read a
  compressed history: "compressed_sparse_attention" (CSA) pools every 4 tokens into one entry and
  lets a lightning indexer pick the `index_topk` entries each query attends to;
  "heavily_compressed_attention" (HCA) pools every 128 tokens and attends to all of them;
  "sliding_attention" layers read the window only. Checkpoints give the schedule as
  `compress_ratios` (0 / 4 / 128 per layer, one extra trailing entry for the MTP block).
- MoE: the first `num_hash_layers` layers route by a frozen token-id -> experts table
  (`tid2eid[input_ids]`), the others by top-k over sqrt(softplus(logits)) plus the
  `e_score_correction_bias`; both weight the chosen experts by the unbiased scores, renormalised
  and scaled by `routed_scaling_factor`. One always-on shared expert per layer.
- The checkpoint's MTP block (`mtp.*`) is not built by transformers.

The released checkpoints store attention and shared-expert weights in block FP8 (e4m3, ue8m0
scales) and the routed experts in FP4 (e2m1 packed in int8, one ue8m0 scale per 32 values);
`load` dequantizes them to the training dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Any

from miles.core.contracts.family import Config, ModelFamily, Notice
from miles.recipes.families.deepseek_v4_config import (
    CSA,
    DEFAULTS,
    HASH_MOE,
    HCA,
    SLIDING,
    compress_rates,
    config_fields,
    layer_types,
    mlp_layer_types,
)
from miles.recipes.families.deepseek_v4_sizing import (
    attention_params,
    hyper_connection_params,
    indexer_params,
    kv_and_state,
    parallel,
    shape,
)
from miles.recipes.families.routers import moe_routers

if TYPE_CHECKING:
    import torch

__all__ = [
    "CHAT_TEMPLATE",
    "CSA",
    "DEFAULTS",
    "HASH_MOE",
    "HCA",
    "SLIDING",
    "SqrtSoftplusRouter",
    "attention_params",
    "compress_rates",
    "deepseek_v4",
    "hyper_connection_params",
    "indexer_params",
    "kv_and_state",
    "layer_types",
    "load",
    "mlp_layer_types",
    "notices",
    "parallel",
    "random_hash_tables",
    "shape",
    "tiny",
]


# --- notices ---------------------------------------------------------------------------------


def _quantization_notices(config: Config) -> list[Notice]:
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        return []
    method = str(quant.get("quant_method", ""))
    if method == "fp8":
        experts = quant.get("expert_dtype") or config.get("expert_dtype")
        return [
            Notice(
                f"FP8 checkpoint (e4m3 blocks of {quant.get('weight_block_size')}, "
                f"{quant.get('scale_fmt', 'float')} scales"
                + (f"; routed experts in {experts}" if experts else "")
                + "): Miles "
                "loads it dequantized to the training dtype (transformers "
                "FineGrainedFP8Config(dequantize=True), asked for by load_causal_lm: without it "
                "transformers would build frozen FP8 modules, and FP4 experts have no backward "
                "there), trains and syncs that dtype, and saves it unquantized; memory is that "
                "of the dequantized model."
            )
        ]
    return [
        Notice(
            f"quantization_config with quant_method {method!r}: Miles loads DeepSeek-V4 from "
            "its FP8/FP4 release or an unquantized checkpoint only.",
            fatal=True,
        )
    ]


def notices(config: Config) -> list[Notice]:
    c = config_fields(config)
    out: list[Notice] = []
    mtp = int(c.get("num_nextn_predict_layers") or 0)
    if mtp > 0:
        out.append(
            Notice(
                f"{mtp} MTP block(s) (num_nextn_predict_layers; checkpoint weights mtp.*): "
                "transformers' DeepseekV4ForCausalLM does not build them, so their weights are "
                "skipped at load, RL does not train them, and checkpoints Miles saves lack them "
                "(MTP speculative decoding needs the original MTP weights)."
            )
        )
    types = layer_types(c)
    if CSA in types:
        topk, rate = int(c["index_topk"]), compress_rates(c)[CSA]
        count = types.count(CSA)
        out.append(
            Notice(
                f"lightning indexer ({count} CSA layers, {indexer_params(c) * count:,} "
                f"parameters): transformers implements its top-{topk} selection of compressed "
                f"entries (sequences up to {topk * rate} tokens read every entry). Its output "
                "is only the top-k indices, so no gradient reaches the indexer: it stays frozen "
                "at the checkpoint's weights, and its own training objective (aligning it with "
                "the main attention, a KL loss) is not implemented by Miles. Routing replay "
                "covers the experts, not this selection."
            )
        )
    out.append(
        Notice(
            "transformers implements DeepSeek-V4 attention in eager mode only (sinks, "
            "head_dim 512, compressed entries appended inside the layer): this family loads it "
            "with attn_implementation='eager' whatever the trainer asks, and eager attention "
            "materialises each layer's scores (heads x tokens x (tokens + compressed entries)), "
            "quadratic in the sequence length."
        )
    )
    out.append(
        Notice(
            "the reference implementation's activation fake-quantisation (FP8 on the KV's "
            "non-rope dims, Hadamard + FP4 on the indexer's queries and keys) is not in "
            "transformers: trainer logprobs differ slightly from an engine that applies it."
        )
    )
    if float(c.get("router_aux_loss_coef") or 0) > 0:
        out.append(
            Notice(
                "expert load balancing does not run in RL: the routers' "
                "e_score_correction_bias is a buffer nothing updates, and transformers' "
                "(softmax) load-balancing loss is only added when router logits are requested."
            )
        )
    # What transformers builds regardless of the config: another value is another model.
    if int(c["n_shared_experts"]) != 1:
        out.append(
            Notice(
                f"n_shared_experts={c['n_shared_experts']}: transformers' DeepseekV4 builds "
                "exactly one shared expert of moe_intermediate_size.",
                fatal=True,
            )
        )
    if not c["norm_topk_prob"]:
        out.append(
            Notice(
                "norm_topk_prob=false: transformers' DeepSeek-V4 routers always renormalise "
                "the top-k weights.",
                fatal=True,
            )
        )
    out.extend(_quantization_notices(config))
    return out


# --- routers ---------------------------------------------------------------------------------


class SqrtSoftplusRouter:
    """DeepSeek-V4's two router kinds. Both score experts with `score_fn(logits)`
    (sqrt(softplus) in the checkpoints) and weight the chosen ones by those scores, renormalised
    (+1e-20) and scaled by `routed_scaling_factor`; they differ only in the choice: top-k of the
    scores plus `e_score_correction_bias` (DeepseekV4TopKRouter), or `tid2eid[input_ids]`
    (DeepseekV4HashRouter). A record of a hash layer is the table lookup itself, so replaying it
    changes nothing; its gate weights still carry the router's gradient."""

    def routers(self, model: Any) -> list[Any]:
        return list(moe_routers(model))  # every DeepSeek-V4 layer is MoE

    def gate_weights(
        self, router: Any, logits: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        import torch.nn.functional as F

        # Same ops, same dtype as the router's forward, so the weights match it exactly.
        score_fn = getattr(router, "score_fn", None)
        scores = score_fn(logits) if score_fn is not None else F.softplus(logits).sqrt()
        weights = scores.gather(-1, indices.long())
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * float(getattr(router, "routed_scaling_factor", 1.0))


# --- loading ---------------------------------------------------------------------------------


def load(path: str, **kwargs: Any) -> Any:
    """AutoModelForCausalLM in eager attention, the only kind transformers implements for
    DeepSeek-V4 (the trainer asks for sdpa by default). The FP8/FP4 release is dequantized by
    `load_causal_lm`, as every pre-quantized checkpoint."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **{**kwargs, "attn_implementation": "eager"})


# --- tiny twin -------------------------------------------------------------------------------


def tiny() -> dict[str, Any]:
    """4 layers with every feature of the release: one sliding-window-only layer, two CSA layers
    (indexer keeping 2 of up to 8 compressed entries) and an HCA layer (rate 8, so a 32-token
    sequence compresses), two hash-routed MoE layers then two top-k ones (8 experts, top-2, a
    shared expert), 4 hyper-connection streams, YaRN on the compressed layers' rope. The indexer
    keeps 8 heads: its scores are sums of ReLUs over heads, and with 2 heads a quarter of them
    are exact zeros whose top-k ties break differently for different sequence lengths."""
    return {
        "model_type": "deepseek_v4",
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,  # 8 rope dims of 32, as the release's 64 of 512
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "layer_types": [SLIDING, CSA, HCA, CSA],
        "compress_rates": {CSA: 4, HCA: 8},
        "mlp_layer_types": [HASH_MOE, HASH_MOE, "moe", "moe"],
        "sliding_window": 8,
        "index_n_heads": 8,
        "index_head_dim": 16,
        "index_topk": 2,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.5,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 4,
        "max_position_embeddings": 256,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 4,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "num_nextn_predict_layers": 0,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }


# --- chat template ---------------------------------------------------------------------------

# The release ships no Jinja template: its chat format is the Python encoder
# `encoding/encoding_dsv4.py`. This family's template renders what that encoder renders for
# system / user / assistant / tool messages, with these HF conventions: tools come as the
# `tools` argument (rendered into the system prompt, as the encoder does for a system message's
# tools; a conversation without a system message gets an empty one, as the serving engines
# insert), tool-call arguments are mappings, the assistant prefix after the last user turn is
# added only with `add_generation_prompt`, and `enable_thinking` (or `thinking`) selects the
# encoder's thinking mode (default: chat mode, i.e. "<｜Assistant｜></think>"). Not rendered:
# the encoder's developer / latest_reminder roles, quick-instruction tasks, response_format, and
# its re-sorting of tool results by call id (results are expected in call order).
#
# The template is the file below, next to this module, one Jinja tag per line (every tag trims
# the whitespace around it, so the file renders as it stands); the string given to tokenizers is
# its lines stripped and joined, whole-line comments dropped.
_TEMPLATE_FILE = "deepseek_v4_chat_template.jinja"


def _chat_template() -> str:
    text = resources.files("miles.recipes.families").joinpath(_TEMPLATE_FILE).read_text("utf-8")
    lines = (line.strip() for line in text.splitlines())
    return "".join(line for line in lines if not line.startswith("{#"))


CHAT_TEMPLATE = _chat_template()


def random_hash_tables(model: Any) -> None:
    """Gives each hash layer a random token -> experts table (distinct experts per token), as a
    real checkpoint has; transformers initialises it to zeros, which would send every token to
    expert 0. Uses the global torch RNG (the twin writer seeds it)."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            if getattr(layer.mlp, "is_hash", False):
                table = layer.mlp.gate.tid2eid
                experts = layer.mlp.gate.num_experts
                for row in table:
                    row.copy_(torch.randperm(experts)[: table.shape[1]])


def deepseek_v4() -> ModelFamily:
    return ModelFamily(
        "deepseek_v4",
        megatron_missing=(
            "manifold-constrained hyper-connections (hc_mult residual streams mixed by "
            "Sinkhorn-projected matrices), shared-KV attention with sinks, a sliding "
            "window and compressed (CSA / HCA) history picked by a lightning indexer, "
            "and hash-routed experts: none of them is a megatron-core GPTModel layer"
        ),
        model_types=("deepseek_v4",),
        router=SqrtSoftplusRouter(),
        shape=shape,
        parallel=parallel,
        notices=notices,
        tiny=tiny,
        tiny_init=random_hash_tables,
        load=load,
        chat_template=CHAT_TEMPLATE,
        summary="DeepSeek-V4 Flash / Pro: hyper-connections, sliding-window + compressed (CSA "
        "with lightning indexer, HCA) shared-KV attention, hash-routed then sqrtsoftplus top-k "
        "MoE",
        checkpoints=("deepseek-ai/DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Pro"),
    )
