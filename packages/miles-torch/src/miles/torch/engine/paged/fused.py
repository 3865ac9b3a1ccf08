# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
"""Fused elementwise steps of the paged forward: a decode step is a few hundred kernels, so the
many small ones (norms, RoPE, the gated activation, residual adds) set its pace more than the
matmuls do at small batch. On CUDA each step below is one Triton kernel; elsewhere it is the
same arithmetic in torch. Rounding follows transformers: sums and norms in fp32, results in the
model's dtype.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * n + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded as a dtype add
            tl.store(res_out_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / n
        y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        tl.store(
            out_ptr + row * n + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=mask
        )

    @triton.jit
    def _qk_norm_rope_kernel(
        qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slots_ptr,
        stride_qkv, stride_cs, eps,
        HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # 0 .. HEADS + 2 * KV_HEADS - 1: q heads, k heads, v heads
        slot = tl.load(slots_ptr + token)  # where this token's K/V go in the cache
        half = tl.arange(0, D // 2)
        base = qkv_ptr + token * stride_qkv + head * D
        lo = tl.load(base + half)
        hi = tl.load(base + D // 2 + half)
        dtype = lo.dtype
        if head >= HEADS + KV_HEADS:  # v: a plain copy into the cache
            out = v_ptr + (slot * KV_HEADS + head - HEADS - KV_HEADS) * D
            tl.store(out + half, lo)
            tl.store(out + D // 2 + half, hi)
        else:
            lo_f, hi_f = lo.to(tl.float32), hi.to(tl.float32)
            if HAS_NORM:
                var = (tl.sum(lo_f * lo_f, axis=0) + tl.sum(hi_f * hi_f, axis=0)) / D
                inv = tl.rsqrt(var + eps)
                w_ptr = qw_ptr if head < HEADS else kw_ptr
                w_lo = tl.load(w_ptr + half).to(tl.float32)
                w_hi = tl.load(w_ptr + D // 2 + half).to(tl.float32)
                lo_f = w_lo * (lo_f * inv).to(dtype).to(tl.float32)
                hi_f = w_hi * (hi_f * inv).to(dtype).to(tl.float32)
                lo_f = lo_f.to(dtype).to(tl.float32)
                hi_f = hi_f.to(dtype).to(tl.float32)
            c_lo = tl.load(cos_ptr + token * stride_cs + half).to(tl.float32)
            c_hi = tl.load(cos_ptr + token * stride_cs + D // 2 + half).to(tl.float32)
            s_lo = tl.load(sin_ptr + token * stride_cs + half).to(tl.float32)
            s_hi = tl.load(sin_ptr + token * stride_cs + D // 2 + half).to(tl.float32)
            new_lo = lo_f * c_lo - hi_f * s_lo
            new_hi = hi_f * c_hi + lo_f * s_hi
            if head < HEADS:
                out = q_ptr + (token * HEADS + head) * D
            else:
                out = k_ptr + (slot * KV_HEADS + head - HEADS) * D
            tl.store(out + half, new_lo.to(dtype))
            tl.store(out + D // 2 + half, new_hi.to(dtype))

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(x_ptr + row * 2 * n + cols, mask=mask, other=0.0)
        up = tl.load(x_ptr + row * 2 * n + n + cols, mask=mask, other=0.0)
        g = gate.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
        tl.store(
            out_ptr + row * n + cols,
            (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
            mask=mask,
        )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual) * weight, x + residual); without `residual`, (norm(x) * weight, x)."""
    if not (x.is_cuda and triton is not None):
        summed = x if residual is None else residual + x
        return _torch_rms_norm(summed, weight, eps), summed
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(x.numel() // n,)](
        x, residual if residual is not None else x, weight, out, res_out, n, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out, res_out


def qk_norm_rope_store(
    qkv: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    q_norm: tuple[torch.Tensor, float] | None,
    k_norm: tuple[torch.Tensor, float] | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Split fused q/k/v rows [tokens, (heads + 2 kv_heads) * head_dim]; q and k get their
    per-head RMSNorm (Qwen3) and RoPE; k and v go straight into their cache slots (caches
    [pages, page_size, kv_heads, head_dim]). Returns q [tokens, heads, head_dim]."""
    tokens = qkv.shape[0]
    if not (qkv.is_cuda and triton is not None):
        q_size, kv_size = heads * head_dim, kv_heads * head_dim
        q = qkv[:, :q_size].view(tokens, heads, head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(tokens, kv_heads, head_dim)
        v = qkv[:, q_size + kv_size :].reshape(tokens, kv_heads, head_dim)
        if q_norm is not None and k_norm is not None:
            q, k = _torch_rms_norm(q, *q_norm), _torch_rms_norm(k, *k_norm)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, _torch_rope(k, c, s))
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
        return _torch_rope(q, c, s)
    q = torch.empty((tokens, heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    has_norm = q_norm is not None and k_norm is not None
    q_weight, eps = q_norm if q_norm is not None else (qkv, 0.0)
    k_weight = k_norm[0] if k_norm is not None else qkv
    _qk_norm_rope_kernel[(tokens, heads + 2 * kv_heads)](
        qkv, q_weight, k_weight, cos, sin, q, k_cache, v_cache, slots,
        qkv.stride(0), cos.stride(0), eps,
        HEADS=heads, KV_HEADS=kv_heads, D=head_dim, HAS_NORM=has_norm,
    )  # fmt: skip
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for rows [gate | up] of [tokens, 2 * intermediate]."""
    n = gate_up.shape[-1] // 2
    if not (gate_up.is_cuda and triton is not None):
        gate, up = gate_up[:, :n], gate_up[:, n:]
        return torch.nn.functional.silu(gate) * up
    out = torch.empty((gate_up.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out
