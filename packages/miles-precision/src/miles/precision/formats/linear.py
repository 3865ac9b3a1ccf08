"""Training-time replacements for `nn.Linear` that compute through a low-precision format.

Each module takes over an existing `nn.Linear`'s `weight` and `bias` Parameter objects, so the
optimizer, state-dict keys and HF names are unchanged and the fp32/bf16 master weight keeps
training. Gradients are straight-through: the backward pass treats the quantizers as identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from miles.precision.formats.fp8 import dequantize_blockwise, fp8_matmul, quantize_blockwise
from miles.precision.formats.int4 import fake_quant_int4
from miles.precision.formats.mxfp8 import dequantize_mx, quantize_mx


class _LinearFrom(nn.Module):
    """Holds a source Linear's Parameters under the same names (`weight`, `bias`)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias

    def _add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " + (
            f"bias={self.bias is not None}"
        )


class _FP8LinearFn(torch.autograd.Function):
    """Forward through the fp8 GEMM; backward as a plain linear with the dequantized weight."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
        q, scale_inv = quantize_blockwise(weight.detach(), block)
        # Saving the fp8 weight (1 byte/elem) rather than its dequantized copy keeps memory low.
        ctx.save_for_backward(x, q, scale_inv)
        ctx.block = block
        ctx.weight_dtype = weight.dtype
        y: torch.Tensor = fp8_matmul(x, q, scale_inv, block)
        return y

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, q, scale_inv = ctx.saved_tensors
        w_dq = dequantize_blockwise(q, scale_inv, ctx.block, dtype=grad_out.dtype)
        grad_x = grad_out @ w_dq if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            grad_w = (g2.t() @ x2.to(g2.dtype)).to(ctx.weight_dtype)
        return grad_x, grad_w, None


class FP8TrainLinear(_LinearFrom):
    """y = x @ W.T + b with W in 128x128-block fp8 and x in 1x128-block fp8 (DeepSeek-V3 style)."""

    def __init__(self, linear: nn.Linear, block: int = 128) -> None:
        super().__init__(linear)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _FP8LinearFn.apply(x, self.weight, self.block)
        return self._add_bias(y)


def _mx_round_trip(t: torch.Tensor, block: int) -> torch.Tensor:
    """Quantize along the last dim to MXFP8 and back, with a straight-through gradient."""
    dq = dequantize_mx(*quantize_mx(t.detach(), block), block=block, dtype=t.dtype)
    out: torch.Tensor = t + (dq - t).detach()
    return out


class MXFP8TrainLinear(_LinearFrom):
    """Emulated MXFP8 GEMM: both operands rounded to 1x32-block MXFP8 along K, multiplied in high
    precision. The backward pass is a plain linear over the rounded operands (no fp8 gradients).
    """

    def __init__(self, linear: nn.Linear, block: int = 32) -> None:
        super().__init__(linear)
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = _mx_round_trip(self.weight, self.block)
        return F.linear(_mx_round_trip(x, self.block), w, self.bias)


class Int4QATLinear(_LinearFrom):
    """Weight-only INT4 quantization-aware training: the forward sees the int4-rounded weight."""

    def __init__(self, linear: nn.Linear, group: int = 128) -> None:
        super().__init__(linear)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, fake_quant_int4(self.weight, self.group), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group={self.group}"


def convert_linears(
    model: nn.Module,
    make: Callable[[nn.Linear], nn.Module],
    skip: Callable[[str], bool] = lambda name: False,
) -> int:
    """Replace every `nn.Linear` below `model` whose qualified name `skip` rejects with `make(it)`.

    Returns how many were replaced. The modules made here are not `nn.Linear`, so a second call
    leaves them alone. `model` itself is never replaced (it has no parent to hold the new module).
    """
    count = 0
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and not skip(name):
                setattr(parent, child_name, make(child))
                count += 1
    return count
