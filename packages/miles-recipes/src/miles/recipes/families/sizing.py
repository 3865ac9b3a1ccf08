"""Shared arithmetic for the families' `shape` functions (torch-free, config dicts in).

Parameter counts are exact and are tested against transformers' own count for the same config.
Activation sizes are estimates of what one decoder layer keeps per token for backward without
recomputation: the inputs of its norms, the outputs of its projections and the MLP's
intermediate activations. They are meant for planning, and say so in the planner's output.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def linear(d_in: int, d_out: int, bias: bool = False) -> int:
    return d_in * d_out + (d_out if bias else 0)


def swiglu(hidden: int, intermediate: int, bias: bool = False) -> int:
    """gate, up and down projections of a SwiGLU MLP."""
    return 2 * linear(hidden, intermediate, bias) + linear(intermediate, hidden, bias)


def swiglu_act(hidden: int, intermediate: int) -> int:
    """Per token: the MLP input, gate and up outputs, silu(gate), the product, the output
    (measured on an H200: autograd keeps silu(gate) for the product's backward)."""
    return hidden + 4 * intermediate + hidden


def rms_norm_act(width: int) -> int:
    """Per token, in elements of the compute dtype: the trainer's fused RMSNorm keeps only its
    input (and one fp32 scale per row). For families that declare their norms fusable
    (`ModelFamily.rms_norms`); transformers' own module keeps 3 (an fp32 input copy and the
    normalised output)."""
    return width


def moe_act(hidden: int, moe_intermediate: int, top_k: int, num_experts: int) -> int:
    """Per token: router logits, and each of the top-k experts' SwiGLU activations."""
    return num_experts + top_k * swiglu_act(hidden, moe_intermediate)


def embeddings(config: Mapping[str, Any]) -> tuple[int, int]:
    """(input embedding, lm_head) parameters; the head is 0 when tied."""
    vocab, hidden = int(config["vocab_size"]), int(config["hidden_size"])
    tied = bool(config.get("tie_word_embeddings", False))
    return vocab * hidden, 0 if tied else vocab * hidden
