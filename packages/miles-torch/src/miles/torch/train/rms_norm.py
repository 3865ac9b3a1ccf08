# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
"""Llama-style RMSNorm, forward and backward, each one Triton kernel, for training on CUDA.

transformers' RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, in fp32 inside) is
eight elementwise kernels forward and about twelve backward, and keeps an fp32 copy of its input
for backward. Here forward is one pass that keeps only one fp32 scale per row; backward is one
pass plus a sum of per-program partial weight gradients. The rounding is transformers': the
normalised value is rounded to the input's dtype before the weight multiplies it.

A model family names the modules that compute exactly this (`ModelFamily.rms_norms`); the
trainer swaps their forward on CUDA (`fuse_rms_norms`). Elsewhere the modules stay as they are.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_MAX_WIDTH = 16384  # one row per program, in registers


def fuse_rms_norms(
    model: torch.nn.Module, class_names: tuple[str, ...], device: torch.device
) -> int:
    """Replace the forward of `model`'s modules of the named classes with the fused kernels
    (only on CUDA, with Triton); returns how many were replaced."""
    if triton is None or device.type != "cuda" or not class_names:
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in class_names and _fusable(module):
            module.forward = partial(_fused_forward, module)
            count += 1
    return count


def fuse_torch_rms_norms(model: torch.nn.Module, device: torch.device) -> int:
    """The same for `torch.nn.RMSNorm` modules (megatron-core's local layer spec builds its norms
    from them): their forward through the fused kernels, on CUDA with Triton; how many."""
    if triton is None or device.type != "cuda":
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (
            isinstance(module, torch.nn.RMSNorm)
            and module.eps is not None
            and isinstance(weight, torch.Tensor)
            and weight.dim() == 1
            and weight.shape[0] <= _MAX_WIDTH
        ):
            module.forward = partial(_fused_torch_forward, module)  # type: ignore[method-assign]
            count += 1
    return count


def _fused_torch_forward(module: torch.nn.RMSNorm, hidden: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor
    if not hidden.is_cuda:
        out = torch.nn.RMSNorm.forward(module, hidden)
    else:
        # torch's rounding: in fp32 throughout, the result in the input's dtype (megatron-core
        # keeps its norm weights in fp32 under bf16 activations).
        out = _RMSNorm.apply(hidden, module.weight, float(module.eps or 0.0), hidden.dtype, False)
    return out


def _fusable(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and weight.shape[0] <= _MAX_WIDTH
        and hasattr(module, "variance_epsilon")
    )


def _fused_forward(module: Any, hidden: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor
    if not hidden.is_cuda:  # e.g. a module moved to the host meanwhile
        out = type(module).forward(module, hidden)
    else:
        dtype = torch.promote_types(hidden.dtype, module.weight.dtype)
        out = _RMSNorm.apply(hidden, module.weight, float(module.variance_epsilon), dtype, True)
    return out


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        out_dtype: torch.dtype,
        round_normed: bool,
    ) -> torch.Tensor:
        """`round_normed`: the normalised value is rounded to the input's dtype before the weight
        multiplies it (transformers); else everything stays in fp32 until the output (torch)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, width = x2.shape
        out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if rows:
            _forward_kernel[(rows,)](
                x2, weight, out, rstd, width, eps,
                BLOCK=triton.next_power_of_2(width), ROUND=round_normed, num_warps=_warps(width),
            )  # fmt: skip
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        ctx.round_normed = round_normed
        return out.reshape(shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight, rstd = ctx.saved_tensors
        rows, width = x2.shape
        grad2 = grad_out.reshape(-1, width).contiguous()
        grad_x = torch.empty_like(x2)
        programs = max(
            1, min(rows, 4 * torch.cuda.get_device_properties(x2.device).multi_processor_count)
        )
        partial_w = torch.empty((programs, width), dtype=torch.float32, device=x2.device)
        if rows:
            _backward_kernel[(programs,)](
                x2, weight, rstd, grad2, grad_x, partial_w, rows, width,
                BLOCK=triton.next_power_of_2(width), ROUND=ctx.round_normed,
                num_warps=_warps(width),
            )  # fmt: skip
        else:
            partial_w.zero_()
        grad_w = partial_w.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x.reshape(ctx.shape), grad_w, None, None, None


def _warps(width: int) -> int:
    return 4 if width <= 1024 else 8 if width <= 4096 else 16


if triton is not None:

    @triton.jit
    def _forward_kernel(
        x_ptr, w_ptr, out_ptr, rstd_ptr, width, eps, BLOCK: tl.constexpr, ROUND: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        valid = cols < width
        x_raw = tl.load(x_ptr + row * width + cols, mask=valid, other=0.0)
        x = x_raw.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        normed = x * rstd
        if ROUND:
            normed = normed.to(x_raw.dtype).to(tl.float32)  # rounded as transformers rounds
        w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        out = w * normed
        tl.store(out_ptr + row * width + cols, out.to(out_ptr.dtype.element_ty), mask=valid)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def _backward_kernel(
        x_ptr, w_ptr, rstd_ptr, grad_ptr, grad_x_ptr, partial_w_ptr, rows, width,
        BLOCK: tl.constexpr, ROUND: tl.constexpr,
    ):  # fmt: skip
        program = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        valid = cols < width
        w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        grad_w = tl.zeros((BLOCK,), tl.float32)
        for row in range(program, rows, programs):
            offs = tl.cast(row, tl.int64) * width + cols
            x_raw = tl.load(x_ptr + offs, mask=valid, other=0.0)
            x = x_raw.to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            dy = tl.load(grad_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            normed = x * rstd
            if ROUND:
                grad_w += dy * normed.to(x_raw.dtype).to(tl.float32)
            else:
                grad_w += dy * normed
            dn = dy * w
            # d/dx of x * rstd(x): rstd * (dn - normed * mean(dn * normed))
            dx = rstd * (dn - normed * (tl.sum(dn * normed, axis=0) / width))
            tl.store(grad_x_ptr + offs, dx.to(grad_x_ptr.dtype.element_ty), mask=valid)
        tl.store(partial_w_ptr + program * width + cols, grad_w, mask=valid)
