"""Symmetric INT4 weights with one scale per group of `group` columns (weight-only, for QAT).

Fake quantization (training) and packing (export to rollout engines) share one code path for scales
and rounding, so the packed weight decodes to exactly the tensor the model trained against.
"""

from __future__ import annotations

import torch

INT4_MIN, INT4_MAX = -8, 7


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """View [..., K] as [..., K/group, group]."""
    k = w.shape[-1]
    if k % group != 0:
        raise ValueError(f"last dim {k} is not a multiple of the int4 group size {group}")
    return w.reshape(*w.shape[:-1], k // group, group)


def int4_scales(w: torch.Tensor, group: int) -> torch.Tensor:
    """One scale per group, amax / 7 in w's dtype: [..., K/group].

    Dividing by 7 rather than 8 keeps the grid symmetric, so +amax and -amax both stay representable.
    """
    amax = _grouped(w.detach(), group).abs().amax(dim=-1)
    scale = amax / INT4_MAX
    # All-zero groups (and amax so small that amax/7 underflows) encode as zeros under any scale.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _codes(w: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """Integer codes in w's dtype: round-half-even(w / s) clamped to [-8, 7].

    Kept in w's dtype (small integers are exact there) so the fake-quant and pack paths divide
    and round identically.
    """
    q = torch.round(_grouped(w, group) / scales.unsqueeze(-1))
    return q.clamp(INT4_MIN, INT4_MAX)


def _apply_scales(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., K/group, group] times their group's scale, flattened back to [..., K]."""
    return (codes * scales.unsqueeze(-1)).flatten(-2)


def fake_quant_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """Round w onto its int4 grid and back, with a straight-through (identity) gradient."""
    scales = int4_scales(w, group)
    dq = _apply_scales(_codes(w.detach(), scales, group), scales)
    # Forward sees dq; backward sees the identity, since rounding's true gradient is zero almost
    # everywhere and would stop training.
    return w + (dq - w).detach()


def pack_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack [N, K] to (uint8 [N, K/2], scales [N, K/group] in w's dtype).

    Codes are two's-complement nibbles; the low nibble holds the even column, the high the odd one.
    """
    if w.shape[-1] % 2 != 0:
        raise ValueError(f"pack_int4 needs an even last dim, got {w.shape[-1]}")
    w = w.detach()
    scales = int4_scales(w, group)
    codes = _codes(w, scales, group).flatten(-2).to(torch.int16)
    nibbles = codes & 0xF  # two's complement of -8..7 in 4 bits
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return packed.to(torch.uint8), scales


def unpack_int4(
    packed: torch.Tensor, scales: torch.Tensor, group: int, dtype: torch.dtype
) -> torch.Tensor:
    """Decode `pack_int4` output to [N, K] in `dtype`, bit-for-bit equal to `fake_quant_int4`."""
    p = packed.to(torch.int16)
    low, high = p & 0xF, (p >> 4) & 0xF
    nibbles = torch.stack([low, high], dim=-1).flatten(-2)
    codes = (nibbles ^ 8) - 8  # sign-extend a 4-bit two's-complement value
    codes = _grouped(codes.to(dtype), group)
    return _apply_scales(codes, scales.to(dtype))
