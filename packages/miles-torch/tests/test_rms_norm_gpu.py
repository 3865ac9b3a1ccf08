"""The fused RMSNorm kernels against transformers' own RMSNorm modules, on CUDA."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from miles.torch.train.rms_norm import fuse_rms_norms, fuse_torch_rms_norms

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [128, 1000, 4096])
def test_fused_rms_norm_equals_transformers(dtype: torch.dtype, width: int) -> None:
    """Output, input gradient and weight gradient of the module, fused and not, for widths
    that are and are not powers of two and more rows than the backward has programs."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = (torch.randn(3000, 2, width, device="cuda", generator=g) * 3).to(dtype)
    grad = torch.randn(x0.shape, device="cuda", generator=g).to(dtype)
    weight = (1 + torch.randn(width, device="cuda", generator=g) * 0.1).to(dtype)

    def run(fused: bool, as_dtype: torch.dtype) -> list[torch.Tensor]:
        norm = Qwen3RMSNorm(width, eps=1e-6).to("cuda", as_dtype)
        norm.weight.data.copy_(weight)
        holder = torch.nn.Sequential(norm)
        assert fuse_rms_norms(holder, ("Qwen3RMSNorm",) if fused else (), x0.device) == fused
        x = x0.to(as_dtype).clone().requires_grad_()
        out = holder(x)
        out.backward(grad.to(as_dtype))
        assert x.grad is not None and norm.weight.grad is not None
        return [out.detach(), x.grad, norm.weight.grad]

    ours, theirs = run(True, dtype), run(False, dtype)
    exact = run(False, torch.float64)
    assert ours[0].dtype == theirs[0].dtype == dtype
    for name, a, b, want in zip(["out", "grad x", "grad weight"], ours, theirs, exact, strict=True):
        ours_err = float((a.double() - want).abs().max())
        theirs_err = float((b.double() - want).abs().max())
        # As close to the fp64 result as transformers' module in the same dtype (the sums run
        # in another order; fp32 sums of the weight gradient are closer than bf16 ones).
        assert ours_err <= 2 * theirs_err + 1e-6 * float(want.abs().max()), (
            name,
            ours_err,
            theirs_err,
        )


def test_fused_norms_in_a_model(tiny_model: Callable[..., str]) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3")).to("cuda")
    ids = torch.randint(3, 128, (2, 17), device="cuda")
    want = model(input_ids=ids).logits
    # 2 layers x (input, post-attention, q, k) + the final norm
    assert fuse_rms_norms(model, ("Qwen3RMSNorm",), torch.device("cuda")) == 9
    torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    assert fuse_rms_norms(model, ("Qwen3RMSNorm",), torch.device("cpu")) == 0


@pytest.mark.parametrize(
    ("dtype", "weight_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        # megatron-core's trainer: fp32 norm weights under bf16 activations.
        (torch.bfloat16, torch.float32),
    ],
)
def test_fused_torch_rms_norm_equals_torch(dtype: torch.dtype, weight_dtype: torch.dtype) -> None:
    """`torch.nn.RMSNorm` (megatron-core's local norms) fused and not: the same output dtype,
    output and gradients within the dtype's rounding; a norm without an eps or on the host is
    left alone."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x0 = (torch.randn(500, 4, 128, device="cuda", generator=g) * 2).to(dtype)
    grad = torch.randn(x0.shape, device="cuda", generator=g).to(dtype)

    def run(fused: bool) -> list[torch.Tensor]:
        norm = torch.nn.RMSNorm(128, eps=1e-6, device="cuda", dtype=weight_dtype)
        norm.weight.data.copy_(1 + torch.arange(128, device="cuda") / 256)
        assert fuse_torch_rms_norms(norm, torch.device("cuda")) == int(fused) or not fused
        x = x0.clone().requires_grad_()
        out = norm(x) if fused else torch.nn.RMSNorm.forward(norm, x)
        out.backward(grad)
        assert x.grad is not None and norm.weight.grad is not None
        return [out.detach(), x.grad, norm.weight.grad]

    ours, theirs = run(True), run(False)
    assert [t.dtype for t in ours] == [t.dtype for t in theirs]
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    assert fuse_torch_rms_norms(torch.nn.RMSNorm(128), torch.device("cuda")) == 0  # eps None
    assert fuse_torch_rms_norms(torch.nn.RMSNorm(128, eps=1e-6), torch.device("cpu")) == 0
