"""The experts of a mixture-of-experts layer, for every token's chosen experts at once.

Token-expert pairs are sorted by expert so each expert's tokens are contiguous; on CUDA in half
precision one grouped GEMM (`grouped_mm`) then runs every expert's gate/up projection and one its
down projection, with no host sync (the group offsets stay on the device), so a decode step with
MoE layers can be captured as a CUDA graph. Elsewhere the experts run one by one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F

from miles.torch.engine.paged.fused import silu_mul

_GROUPED_MM = cast(
    "Callable[..., torch.Tensor] | None",
    getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None),
)


def grouped(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether experts run as grouped GEMMs (and so without a host sync) there."""
    return (
        _GROUPED_MM is not None
        and device.type == "cuda"
        and dtype in (torch.bfloat16, torch.float16)
    )


def experts_forward(
    x: torch.Tensor,
    indices: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert[indices[t, j]](x[t]) for tokens x [tokens, hidden], with
    gate_up [experts, 2 * inter, hidden] (gate rows first) and down [experts, hidden, inter]."""
    tokens, top_k = indices.shape
    num_experts = gate_up.shape[0]
    flat = indices.reshape(-1)
    order = flat.argsort(stable=True)
    sorted_x = x[order // top_k]  # token-expert pairs, grouped by expert
    if grouped(x.device, x.dtype):
        assert _GROUPED_MM is not None
        counts = torch.zeros(num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = counts.cumsum(0, dtype=torch.int32)
        hidden = silu_mul(_GROUPED_MM(sorted_x, gate_up.transpose(1, 2), offs=offsets))
        out = _GROUPED_MM(hidden, down.transpose(1, 2), offs=offsets)
    else:
        out = _expert_loop(sorted_x, flat[order], gate_up, down)
    pairs = torch.empty_like(out)
    pairs[order] = out  # back to (token, choice) order
    scaled = pairs.view(tokens, top_k, -1) * weights.unsqueeze(-1).to(out.dtype)
    return scaled.sum(dim=1)


def _expert_loop(
    sorted_x: torch.Tensor, sorted_experts: torch.Tensor, gate_up: torch.Tensor, down: Any
) -> torch.Tensor:
    """Each expert in turn over its contiguous rows (syncs once for the row counts)."""
    counts = torch.bincount(sorted_experts, minlength=gate_up.shape[0]).tolist()
    out = torch.empty_like(sorted_x)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = sorted_x[start : start + n]
            hidden = silu_mul(F.linear(rows, gate_up[expert]))
            out[start : start + n] = F.linear(hidden, down[expert])
            start += n
    return out
