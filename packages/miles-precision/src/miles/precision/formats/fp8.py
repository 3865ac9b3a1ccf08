"""FP8 E4M3 with 128x128 weight blocks and 1x128 activation blocks (the DeepSeek-V3 recipe).

A weight block shares one fp32 `scale_inv` (amax / 448), so one outlier only costs precision in its
own block. Activations are scaled per token per 128 columns, so `fp8_matmul` multiplies one K-block
at a time and applies both scales to the fp32 partial product before summing the blocks.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


def _block_amax(w: torch.Tensor, block: int) -> torch.Tensor:
    """Max |w| over each block x block tile; a ragged edge is padded with zeros, which never win."""
    n, k = w.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    padded = F.pad(w.abs().float(), (0, kb * block - k, 0, nb * block - n))
    return padded.view(nb, block, kb, block).amax(dim=(1, 3))


def _expand_blocks(scale: torch.Tensor, shape: torch.Size, block: int) -> torch.Tensor:
    """Broadcast one value per block back to every element of a `shape` tensor."""
    full = scale.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return full[: shape[0], : shape[1]]


def quantize_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a [N, K] weight to E4M3 with one `scale_inv` per block x block tile.

    Returns (q, scale_inv) with w ≈ q.float() * scale_inv of its tile; scale_inv is fp32
    [ceil(N/block), ceil(K/block)].
    """
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise expects a 2-D weight, got shape {tuple(w.shape)}")
    amax = _block_amax(w, block)
    # An all-zero tile would divide by zero; any positive scale encodes it exactly as zeros.
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = w.float() / _expand_blocks(scale_inv, w.shape, block)
    # fp32 division can land a hair above 448, and casts above the max are NaN on some devices.
    q = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv


def dequantize_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_blockwise`: q * scale_inv of its tile, in fp32, then cast to `dtype`."""
    return (q.float() * _expand_blocks(scale_inv, q.shape, block)).to(dtype)


def quantize_activations(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize [M, K] activations per token per `block` columns: scales are fp32 [M, ceil(K/block)]."""
    m, k = x.shape
    kb = math.ceil(k / block)
    padded = F.pad(x.float(), (0, kb * block - k)).view(m, kb, block)
    amax = padded.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, kb * block)[:, :k], scale


@functools.cache
def scaled_mm_available(device_type: str) -> bool:
    """Whether this torch build runs an fp8 `_scaled_mm` on `device_type` (one tiny call,
    cached: support cannot change)."""
    try:
        a = torch.ones(16, 16, device=device_type).to(FP8_DTYPE)
        one = torch.ones((), device=device_type)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, ValueError, NotImplementedError, AttributeError):
        # A torch build or device without fp8 `_scaled_mm` raises one of these, depending on
        # the version.
        return False
    return True


def fp8_backend(device: torch.device | str = "cpu") -> str:
    """Which path `fp8_matmul` takes on `device`: "scaled_mm" (fp8 GEMM) where an accelerator
    runs it, else "dequant" (the same arithmetic on the dequantized operands, in fp32). Always
    "dequant" on the CPU: torch's CPU `_scaled_mm` is a reference kernel, 100 to 500 times
    slower than the fp32 matmul (40x slower fp8 training steps on the quickstart)."""
    device_type = torch.device(device).type
    if device_type == "cpu" or not scaled_mm_available(device_type):
        return "dequant"
    return "scaled_mm"


def _scaled_mm_fits(x: torch.Tensor, n: int, block: int) -> bool:
    # Accelerator fp8 GEMMs want every dim a multiple of 16; the CPU kernel takes any shape.
    if x.device.type == "cpu":
        return True
    return x.shape[0] % 16 == 0 and n % 16 == 0 and x.shape[1] % block == 0 and block % 16 == 0


def _matmul_scaled_mm(
    qx: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int
) -> torch.Tensor:
    """fp8 GEMM per K-block with unit scales; both real scales go into an fp32 epilogue.

    Unit (tensor-wise) scales are the one `_scaled_mm` mode every backend accepts with fp32 output,
    and scaling the fp32 partial product is exactly what a row-wise fused epilogue would compute.
    """
    n, k = q.shape
    one = torch.ones((), device=qx.device)
    out = torch.zeros(qx.shape[0], n, device=qx.device, dtype=torch.float32)
    for kb, k0 in enumerate(range(0, k, block)):
        k1 = min(k0 + block, k)
        # mat1 must be row-major and mat2 column-major: slice, make contiguous, transpose.
        part = torch._scaled_mm(
            qx[:, k0:k1].contiguous(),
            q[:, k0:k1].contiguous().t(),
            scale_a=one,
            scale_b=one,
            out_dtype=torch.float32,
        )
        w_scale = scale_inv[:, kb].repeat_interleave(block)[:n]
        out += part * sx[:, kb : kb + 1] * w_scale
    return out


def _matmul_dequant(
    qx: torch.Tensor, sx: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int
) -> torch.Tensor:
    """The same numbers as `_matmul_scaled_mm`, computed by dequantizing both operands to fp32."""
    x = qx.float() * sx.repeat_interleave(block, dim=1)[:, : qx.shape[1]]
    return x @ dequantize_blockwise(q, scale_inv, block).t()


def fp8_matmul(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: int = 128
) -> torch.Tensor:
    """y = x @ w.T for a blockwise-fp8 weight (q, scale_inv) of shape [N, K]; x is [..., K].

    x is quantized to fp8 per token per `block` columns and products accumulate in fp32; the result
    is cast back to x.dtype.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    qx, sx = quantize_activations(x2, block)
    use_mm = fp8_backend(x.device) == "scaled_mm" and _scaled_mm_fits(x2, q.shape[0], block)
    matmul = _matmul_scaled_mm if use_mm else _matmul_dequant
    y = matmul(qx, sx, q, scale_inv, block)
    return y.to(x.dtype).reshape(*lead, q.shape[0])
