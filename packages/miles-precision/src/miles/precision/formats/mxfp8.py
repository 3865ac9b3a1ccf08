"""MXFP8 (OCP Microscaling v1.0): E4M3 elements in 1x32 blocks along K, one E8M0 scale per block.

The shared scale is a pure power of two, 2^(floor(log2(amax)) - 8), where 8 is E4M3's largest
exponent; it is stored as its exponent biased by 127 in a uint8 (255 would be NaN, never written).
Following the spec, elements that still overflow after scaling (amax / scale lies in [256, 512))
saturate to ±448.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from miles.precision.formats.fp8 import FP8_DTYPE, FP8_MAX

E4M3_EMAX = 8  # floor(log2(448))
E8M0_BIAS = 127
_E8M0_MIN, _E8M0_MAX = -127, 127  # 2^-127 .. 2^127; the biased code 255 is reserved for NaN


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """View [..., K] as [..., ceil(K/block), block] in fp32, zero-padding a ragged last block."""
    k = x.shape[-1]
    kb = math.ceil(k / block)
    return F.pad(x.float(), (0, kb * block - k)).view(*x.shape[:-1], kb, block)


def e8m0_to_float(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """Decode biased E8M0 exponents to fp32 powers of two (exact: 2^-127 is an fp32 subnormal)."""
    return torch.exp2(scale_e8m0.float() - E8M0_BIAS)


def quantize_mx(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [..., K] along K to E4M3 with one E8M0 scale per `block` elements.

    Returns (q float8_e4m3fn [..., K], scale_e8m0 uint8 [..., ceil(K/block)]).
    """
    blocks = _blocks(w, block)
    amax = blocks.abs().amax(dim=-1)
    # frexp gives amax = m * 2^e with m in [0.5, 1), so floor(log2(amax)) = e - 1 exactly, with
    # none of log2's rounding. A zero block gets the smallest scale; its elements encode as zero.
    _, exponent = torch.frexp(amax)
    shared = torch.where(amax > 0, exponent - 1 - E4M3_EMAX, torch.full_like(exponent, _E8M0_MIN))
    shared = shared.clamp(_E8M0_MIN, _E8M0_MAX)
    scaled = blocks / torch.exp2(shared.float()).unsqueeze(-1)
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*w.shape[:-1], -1)[..., : w.shape[-1]]
    return q, (shared + E8M0_BIAS).to(torch.uint8)


def dequantize_mx(
    q: torch.Tensor, scales: torch.Tensor, block: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_mx`: each element times its block's power-of-two scale."""
    scale = e8m0_to_float(scales).repeat_interleave(block, dim=-1)[..., : q.shape[-1]]
    return (q.float() * scale).to(dtype)
