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

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from miles.core.family import Config, ModelFamily, ModelShape, Notice, ParallelHints, ParamCounts
from miles.recipes.families.routers import moe_routers
from miles.recipes.families.sizing import embeddings, linear, moe_act, swiglu, swiglu_act

if TYPE_CHECKING:
    import torch

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"

# DeepseekV4Config's legacy per-layer `compress_ratios` values (what the checkpoints ship).
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

# transformers' DeepseekV4Config defaults (documented there as DeepSeek-V4-Flash-Base) for the
# fields this module reads.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "compress_rates": {CSA: 4, HCA: 128},
    "hc_mult": 4,
    "num_hash_layers": 3,  # `default_num_hash_layers`; configs name it as the legacy kwarg
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "mlp_bias": False,
    "router_aux_loss_coef": 0.001,
}


def _fields(config: Config) -> dict[str, Any]:
    """config.json fields over transformers' defaults (a None field means "default" there)."""
    out = dict(DEFAULTS)
    out.update({k: v for k, v in config.items() if v is not None})
    if "num_local_experts" in config:  # DeepseekV4Config's attribute_map alias
        out["n_routed_experts"] = config["num_local_experts"]
    return out


def layer_types(c: Mapping[str, Any]) -> list[str]:
    """The attention kind of each layer, as DeepseekV4Config.__post_init__ derives it: explicit
    `layer_types`, else the legacy `compress_ratios`, else its V4-Pro-like default (two HCA
    layers, then HCA / CSA alternating); cut to `num_hidden_layers` (the checkpoints' lists have
    one more entry, for the MTP block)."""
    n = int(c["num_hidden_layers"])
    if c.get("layer_types") is not None:
        types = list(c["layer_types"])
    elif c.get("compress_ratios") is not None:
        unknown = [r for r in c["compress_ratios"] if int(r) not in _RATIO_TO_TYPE]
        if unknown:
            raise ValueError(f"compress_ratios values {unknown}: DeepSeek-V4 knows 0, 4 and 128")
        types = [_RATIO_TO_TYPE[int(r)] for r in c["compress_ratios"]]
    else:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return types[:n]


def mlp_layer_types(c: Mapping[str, Any]) -> list[str]:
    """ "hash_moe" (routed by the token-id table) or "moe" (top-k routed) per layer."""
    n = int(c["num_hidden_layers"])
    if c.get("mlp_layer_types") is not None:
        return list(c["mlp_layer_types"])[:n]
    hashed = min(n, int(c["num_hash_layers"]))
    return [HASH_MOE] * hashed + ["moe"] * (n - hashed)


def compress_rates(c: Mapping[str, Any]) -> dict[str, int]:
    """Tokens pooled into one compressed entry, per compressed layer kind."""
    rates = {**DEFAULTS["compress_rates"], **(c.get("compress_rates") or {})}
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if c.get(legacy) is not None:
            rates[kind] = int(c[legacy])
    return {kind: int(rate) for kind, rate in rates.items()}


# --- parameters -----------------------------------------------------------------------------


def _compressor_params(hidden: int, width: int, rate: int, out_dim: int) -> int:
    """kv_proj and gate_proj to `width`, the per-slot position bias, the output RMSNorm."""
    return 2 * linear(hidden, width) + rate * width + out_dim


def indexer_params(c: Mapping[str, Any]) -> int:
    """The lightning indexer of a CSA layer: its own overlapping compressor at index_head_dim,
    the query up-projection from the shared q latent, the per-head weights projection."""
    hidden, q_rank = int(c["hidden_size"]), int(c["q_lora_rank"])
    heads, dim = int(c["index_n_heads"]), int(c["index_head_dim"])
    rate = compress_rates(c)[CSA]
    return (
        _compressor_params(hidden, 2 * dim, rate, dim)
        + linear(q_rank, heads * dim)
        + linear(hidden, heads)
    )


def attention_params(c: Mapping[str, Any], kind: str) -> int:
    """One attention block: low-rank q (with its latent norm), the shared kv projection and norm,
    the grouped output projection, the sinks, and the layer kind's compressor."""
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    head_dim = int(c["head_dim"])
    q_rank, groups, o_rank = int(c["q_lora_rank"]), int(c["o_groups"]), int(c["o_lora_rank"])
    params = (
        linear(hidden, q_rank)  # q_a_proj
        + q_rank  # q_a_norm
        + linear(q_rank, heads * head_dim)  # q_b_proj (its per-head norm has no weight)
        + linear(hidden, head_dim)  # kv_proj: one head, read as key and value
        + head_dim  # kv_norm
        + (heads * head_dim // groups) * (groups * o_rank)  # o_a_proj, block-diagonal
        + linear(groups * o_rank, hidden)  # o_b_proj
        + heads  # sinks
    )
    rates = compress_rates(c)
    if kind == CSA:  # two overlapping series of head_dim each, plus the indexer
        params += _compressor_params(hidden, 2 * head_dim, rates[CSA], head_dim)
        params += indexer_params(c)
    elif kind == HCA:
        params += _compressor_params(hidden, head_dim, rates[HCA], head_dim)
    return params


def hyper_connection_params(c: Mapping[str, Any]) -> int:
    """One mHC module: a projection of the flattened streams to (pre, post, comb) weights, their
    bias and three scales."""
    hc, hidden = int(c["hc_mult"]), int(c["hidden_size"])
    mixes = (2 + hc) * hc
    return mixes * hc * hidden + mixes + 3


# --- activations, KV cache ------------------------------------------------------------------


def _attention_act(c: Mapping[str, Any], kind: str) -> int:
    """Per token, what an attention block keeps for backward: its input, the q latent (and its
    norm), q before and after norm/rope, the kv head, the attention output (and its rope undone),
    the grouped projection's output, the block output. The scores themselves grow with the
    sequence (eager attention over window + compressed entries) and are left out."""
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    head_dim = int(c["head_dim"])
    q_rank, groups, o_rank = int(c["q_lora_rank"]), int(c["o_groups"]), int(c["o_lora_rank"])
    act = hidden + 2 * q_rank + 4 * heads * head_dim + 2 * head_dim + groups * o_rank + hidden
    if kind == CSA:  # compressor kv / gate (2 series), indexer kv / gate, query and head weights
        dim, index_heads = int(c["index_head_dim"]), int(c["index_n_heads"])
        act += 4 * head_dim + 4 * dim + index_heads * dim + index_heads
    elif kind == HCA:
        act += 2 * head_dim
    return act


def _hyper_connection_act(c: Mapping[str, Any]) -> int:
    """Per token and mHC module: the streams (read, normalised, mixed) and the collapsed input."""
    hc, hidden = int(c["hc_mult"]), int(c["hidden_size"])
    return 3 * hc * hidden + hidden + (2 + hc) * hc


def kv_and_state(c: Mapping[str, Any]) -> tuple[int, int]:
    """(KV-cache elements per token, fixed elements per sequence), summed over layers.

    Per token (what grows with the sequence; transformers' DeepseekV4CSACache/HCACache hold
    exactly this): a CSA layer keeps one head_dim entry per `rate_csa` tokens and the indexer's
    index_head_dim key per `rate_csa` tokens; an HCA layer one head_dim entry per `rate_hca`
    tokens; sliding layers nothing. Fractions are summed, then rounded up.

    Per sequence (bounded): every layer's sliding window of K=V entries (`sliding_window` x
    head_dim; K and V are one tensor), and each compressor's pending state. That state is
    estimated as the reference implementation's fp32 decode ring (kv and gate scores of
    `rate` tokens by the compressor's width, doubled for CSA's overlapping windows), an upper
    bound of what transformers buffers (the tokens of the open window plus the previous
    window's overlap half).
    """
    head_dim, dim = int(c["head_dim"]), int(c["index_head_dim"])
    window, rates = int(c["sliding_window"]), compress_rates(c)
    per_token, per_seq = Fraction(0), 0
    for kind in layer_types(c):
        per_seq += window * head_dim
        if kind == CSA:
            rate = rates[CSA]
            per_token += Fraction(head_dim + dim, rate)
            per_seq += 2 * (2 * rate) * (2 * head_dim) + 2 * (2 * rate) * (2 * dim)
        elif kind == HCA:
            rate = rates[HCA]
            per_token += Fraction(head_dim, rate)
            per_seq += 2 * rate * head_dim
    return math.ceil(per_token), per_seq


def shape(config: Config) -> ModelShape:
    c = _fields(config)
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    experts, top_k = int(c["n_routed_experts"]), int(c["num_experts_per_tok"])
    inter, hc = int(c["moe_intermediate_size"]), int(c["hc_mult"])
    bias = bool(c["mlp_bias"])

    embedding, lm_head = embeddings(c)
    layer_params = expert_params = act = 0
    for kind in layer_types(c):
        layer_params += attention_params(c, kind)
        layer_params += 2 * hyper_connection_params(c) + 2 * hidden  # attn/ffn mHC, two norms
        # Router weight (e_score_correction_bias and tid2eid are buffers) and the one shared
        # expert, which transformers builds at moe_intermediate_size whatever n_shared_experts.
        layer_params += experts * hidden + swiglu(hidden, inter, bias)
        expert_params += experts * swiglu(hidden, inter)
        act += _attention_act(c, kind) + 2 * _hyper_connection_act(c) + 2 * hidden
        act += moe_act(hidden, inter, top_k, experts) + swiglu_act(hidden, inter)

    kv, state = kv_and_state(c)
    return ModelShape(
        params=ParamCounts(
            embedding=embedding,
            lm_head=lm_head,
            layers=layer_params,
            experts=expert_params,
            other=hidden + hc * hc * hidden + hc + 1,  # final norm, the head's stream collapse
        ),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=int(c["vocab_size"]),
        active_expert_params=layers * top_k * swiglu(hidden, inter),
        kv_elems_per_token=kv,
        state_elems_per_seq=state,
        act_elems_per_token=act,
    )


def parallel(config: Config) -> ParallelHints:
    c = _fields(config)
    # Heads shard by attention head and by output group (the grouped projection is
    # block-diagonal over groups); the indexer by its heads; experts by their width. The single
    # shared KV head is replicated.
    return ParallelHints(
        tensor_divides=(
            ("num_attention_heads", int(c["num_attention_heads"])),
            ("o_groups", int(c["o_groups"])),
            ("index_n_heads", int(c["index_n_heads"])),
            ("moe_intermediate_size", int(c["moe_intermediate_size"])),
        ),
        expert_divides=(("n_routed_experts", int(c["n_routed_experts"])),),
    )


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
    c = _fields(config)
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
# `encoding/encoding_dsv4.py`. The template below renders what that encoder renders for
# system / user / assistant / tool messages, with these HF conventions: tools come as the
# `tools` argument (rendered into the system prompt, as the encoder does for a system message's
# tools; a conversation without a system message gets an empty one, as the serving engines
# insert), tool-call arguments are mappings, the assistant prefix after the last user turn is
# added only with `add_generation_prompt`, and `enable_thinking` (or `thinking`) selects the
# encoder's thinking mode (default: chat mode, i.e. "<｜Assistant｜></think>"). Not rendered:
# the encoder's developer / latest_reminder roles, quick-instruction tasks, response_format, and
# its re-sorting of tool results by call id (results are expected in call order).
_DSML = "｜DSML｜"
_TOOLS_HEAD = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke "
    f'tools by writing a "<{_DSML}tool_calls>" block like the following:\n\n'
    f"<{_DSML}tool_calls>\n"
    f'<{_DSML}invoke name="$TOOL_NAME">\n'
    f'<{_DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    f"</{_DSML}parameter>\n"
    "...\n"
    f"</{_DSML}invoke>\n"
    f'<{_DSML}invoke name="$TOOL_NAME2">\n'
    "...\n"
    f"</{_DSML}invoke>\n"
    f"</{_DSML}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    "(numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
_TOOLS_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)
_REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential"
    " paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)


def _literal(text: str) -> str:
    """`text` as a Jinja string literal."""
    escaped = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
    return f"'{escaped}'"


CHAT_TEMPLATE = (
    "{%- macro text_of(content) -%}"
    "{%- if content is not defined or content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}"
    "{%- for part in content -%}"
    "{%- if not loop.first -%}{{- '\\n\\n' -}}{%- endif -%}"
    "{{- part.text if part.text is defined else part -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro render_tools(tools) -%}"
    "{{- " + _literal(_TOOLS_HEAD) + " -}}"
    "{%- for tool in tools -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- (tool.function if tool.function is defined else tool) | tojson -}}"
    "{%- endfor -%}"
    "{{- " + _literal(_TOOLS_TAIL) + " -}}"
    "{%- endmacro -%}"
    "{%- set thinking_mode = (enable_thinking is defined and enable_thinking)"
    " or (thinking is defined and thinking) -%}"
    # The encoder keeps every turn's reasoning when tools are in play, else only the last turn's.
    "{%- set drop_thinking = not tools -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role in ['user', 'tool'] -%}{%- set ns.last_user = loop.index0 "
    "-%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if bos_token is defined and bos_token -%}{{- bos_token -}}{%- endif -%}"
    "{%- if thinking_mode and reasoning_effort is defined and reasoning_effort == 'max' -%}"
    "{{- " + _literal(_REASONING_EFFORT_MAX) + " -}}"
    "{%- endif -%}"
    "{%- if tools and (messages | length == 0 or messages[0].role != 'system') -%}"
    "{{- '\\n\\n' + render_tools(tools) -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set i = loop.index0 -%}"
    "{%- if message.role == 'system' -%}"
    "{{- text_of(message.content) -}}"
    "{%- if i == 0 and tools -%}{{- '\\n\\n' + render_tools(tools) -}}{%- endif -%}"
    "{%- elif message.role in ['user', 'tool'] -%}"
    # Consecutive user turns and tool results merge into one user turn.
    "{%- if i > 0 and messages[i - 1].role in ['user', 'tool'] -%}{{- '\\n\\n' -}}"
    "{%- else -%}{{- '<｜User｜>' -}}{%- endif -%}"
    "{%- if message.role == 'tool' -%}"
    "{{- '<tool_result>' + text_of(message.content) + '</tool_result>' -}}"
    "{%- else -%}{{- text_of(message.content) -}}{%- endif -%}"
    "{%- set following = messages[i + 1].role if i + 1 < messages | length else none -%}"
    "{%- if following == 'assistant' or (following is none and add_generation_prompt) -%}"
    "{{- '<｜Assistant｜>' -}}"
    "{%- if thinking_mode and (not drop_thinking or i >= ns.last_user) -%}{{- '<think>' -}}"
    "{%- else -%}{{- '</think>' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if thinking_mode and (not drop_thinking or i > ns.last_user) -%}"
    "{{- (message.reasoning_content or '') + '</think>' -}}"
    "{%- endif -%}"
    "{{- text_of(message.content) -}}"
    "{%- if message.tool_calls -%}"
    "{{- '\\n\\n<" + _DSML + "tool_calls>\\n' -}}"
    "{%- for call in message.tool_calls -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- if fn.arguments is not mapping -%}"
    "{{- raise_exception('DeepSeek-V4 chat template: tool call arguments must be a "
    "mapping') -}}"
    "{%- endif -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- " + _literal(f'<{_DSML}invoke name="') + " + fn.name + " + _literal('">\n') + " -}}"
    "{%- for key, value in fn.arguments.items() -%}"
    "{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- " + _literal(f'<{_DSML}parameter name="') + " + key -}}"
    "{%- if value is string -%}{{- " + _literal('" string="true">') + " + value -}}"
    "{%- else -%}{{- " + _literal('" string="false">') + " + (value | tojson) -}}"
    "{%- endif -%}"
    "{{- '</" + _DSML + "parameter>' -}}"
    "{%- endfor -%}"
    "{{- '\\n</" + _DSML + "invoke>' -}}"
    "{%- endfor -%}"
    "{{- '\\n</" + _DSML + "tool_calls>' -}}"
    "{%- endif -%}"
    "{{- eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


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
