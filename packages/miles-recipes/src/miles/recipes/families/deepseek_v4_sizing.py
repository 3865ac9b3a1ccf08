"""DeepSeek-V4's sizes: parameters per block, activations kept for backward, KV cache and
per-sequence state, and how tensor / expert parallelism may shard the model."""

from __future__ import annotations

import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from miles.core.contracts.family import Config, ModelShape, ParallelHints, ParamCounts
from miles.recipes.families.deepseek_v4_config import (
    CSA,
    HCA,
    compress_rates,
    config_fields,
    layer_types,
)
from miles.recipes.families.sizing import embeddings, linear, moe_act, swiglu, swiglu_act

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
    c = config_fields(config)
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
    c = config_fields(config)
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
