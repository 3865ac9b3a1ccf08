import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

from miles.precision.formats.fp8 import (
    FP8_MAX,
    _matmul_dequant,
    _matmul_scaled_mm,
    dequantize_blockwise,
    fp8_backend,
    fp8_matmul,
    quantize_activations,
    quantize_blockwise,
    scaled_mm_available,
)
from miles.precision.formats.int4 import fake_quant_int4, int4_scales, pack_int4, unpack_int4
from miles.precision.formats.linear import (
    FP8TrainLinear,
    Int4QATLinear,
    MXFP8TrainLinear,
    convert_linears,
)
from miles.precision.formats.mxfp8 import dequantize_mx, e8m0_to_float, quantize_mx

torch.set_num_threads(1)

MakeLinear = Callable[[nn.Linear], nn.Module]

# E4M3 keeps 3 mantissa bits: rounding a normal value v moves it by at most half an ulp,
# 2^(floor(log2|v|) - 4) <= |v| * 2^-4. Below the smallest normal (2^-6) the grid is 2^-9 apart,
# so the error is at most 2^-10. Both are in units of the block scale.
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL_ABS = 2.0**-10
SLACK = 1 + 1e-5  # fp32 rounding of the division and of the product


def _weights_with_outlier(n: int, k: int, block: int) -> torch.Tensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1))
    w[:block, :block] *= 1000.0  # one tile whose scale must not leak into the others
    return w


def _fp8_block_scale(w: torch.Tensor, block: int) -> torch.Tensor:
    amax = torch.zeros(math.ceil(w.shape[0] / block), math.ceil(w.shape[1] / block))
    for i in range(amax.shape[0]):
        for j in range(amax.shape[1]):
            amax[i, j] = w[i * block : (i + 1) * block, j * block : (j + 1) * block].abs().max()
    return amax


@pytest.mark.parametrize("outlier", [False, True])
def test_fp8_blockwise_round_trip_is_within_half_an_ulp(outlier: bool) -> None:
    block = 32
    w = (
        _weights_with_outlier(96, 80, block)
        if outlier
        else torch.randn(96, 80, generator=torch.Generator().manual_seed(0))
    )
    q, scale_inv = quantize_blockwise(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 3)
    amax = _fp8_block_scale(w, block)
    torch.testing.assert_close(scale_inv, amax / FP8_MAX)

    err = (w - dequantize_blockwise(q, scale_inv, block)).abs()
    s = scale_inv.repeat_interleave(block, 0).repeat_interleave(block, 1)[:96, :80]
    bound = torch.maximum(w.abs() * E4M3_REL, s * E4M3_SUBNORMAL_ABS) * SLACK
    assert (err <= bound).all()
    # Per tile: |v| <= 448 lies in the binade [256, 448], whose half-ulp is 16, so the error is at
    # most 16 * scale_inv = amax / 28, tighter than the loose amax * 2^-4.
    tile_err = _fp8_block_scale(err, block)
    assert (tile_err <= amax / 28 * SLACK).all()
    if outlier:
        # Tiles away from the outlier keep their own small scale, hence their small error.
        assert tile_err[1:, 1:].max() < 0.2
        assert tile_err[0, 0] > 1.0


def test_fp8_zero_block_round_trips_to_zero() -> None:
    w = torch.zeros(4, 8)
    q, scale_inv = quantize_blockwise(w, block=4)
    assert torch.equal(scale_inv, torch.ones(1, 2))
    assert torch.equal(dequantize_blockwise(q, scale_inv, block=4), w)


def test_fp8_backend_reports_a_known_path() -> None:
    assert fp8_backend() == "dequant"  # the CPU's _scaled_mm is a slow reference kernel
    assert fp8_backend("cpu") == fp8_backend(torch.device("cpu"))
    if torch.cuda.is_available():
        expected = "scaled_mm" if scaled_mm_available("cuda") else "dequant"
        assert fp8_backend("cuda") == expected


# Comparing the two paths needs both; a build without fp8 `_scaled_mm` only has "dequant",
# which every other fp8 test here exercises.
@pytest.mark.skipif(not scaled_mm_available("cpu"), reason="no fp8 _scaled_mm on this CPU build")
def test_fp8_scaled_mm_and_dequant_paths_agree() -> None:
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 200, generator=g), torch.randn(70, 200, generator=g)
    q, scale_inv = quantize_blockwise(w)
    qx, sx = quantize_activations(x)
    a = _matmul_scaled_mm(qx, sx, q, scale_inv, 128)
    b = _matmul_dequant(qx, sx, q, scale_inv, 128)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matmul_is_close_to_full_precision(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 300, generator=g).to(dtype)  # K spans two full blocks and a ragged one
    w = torch.randn(150, 300, generator=g).to(dtype)
    y = fp8_matmul(x, *quantize_blockwise(w))
    assert y.shape == (2, 9, 150) and y.dtype == dtype
    ref = x.float() @ w.float().t()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    # Two e4m3 operands, each ~2.5% RMS relative rounding error: about 3.7% measured.
    assert rel < 0.05, rel
    assert rel > 1e-3, "fp8 rounding should be visible; was the matmul done in full precision?"


def test_fp8_matmul_quantizes_each_token_and_k_block_on_its_own() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, 256, generator=g)
    x[0, :128] *= 1e4  # an outlier in one (token, K-block) must not coarsen any other
    w = torch.randn(40, 256, generator=g)
    q, scale_inv = quantize_blockwise(w)
    # Reference written out directly: one scale per token per 128 columns, amax / 448.
    xq = torch.empty_like(x)
    for row in range(6):
        for k0 in (0, 128):
            chunk = x[row, k0 : k0 + 128]
            s = chunk.abs().max() / FP8_MAX
            xq[row, k0 : k0 + 128] = (chunk / s).to(torch.float8_e4m3fn).float() * s
    ref = xq @ dequantize_blockwise(q, scale_inv).t()
    torch.testing.assert_close(fp8_matmul(x, q, scale_inv), ref, rtol=1e-5, atol=1e-3)
    weight_only = x @ dequantize_blockwise(q, scale_inv).t()
    assert not torch.allclose(ref, weight_only, rtol=1e-3, atol=1e-3)


def test_mx_scales_are_powers_of_two_from_the_block_amax() -> None:
    w = torch.tensor([[1.0] * 31 + [3.0], [0.0] * 32])
    q, scales = quantize_mx(w, block=32)
    assert scales.dtype == torch.uint8 and scales.shape == (2, 1)
    # amax 3 -> floor(log2 3) = 1 -> shared exponent 1 - 8 = -7, biased 120. A zero block gets
    # the smallest exponent, and still decodes to zeros.
    assert scales[0, 0].item() == 127 - 7
    assert scales[1, 0].item() == 0
    assert e8m0_to_float(torch.tensor([127, 120, 0], dtype=torch.uint8)).tolist() == [
        1.0,
        2.0**-7,
        2.0**-127,
    ]
    torch.testing.assert_close(dequantize_mx(q, scales, block=32), w, rtol=0, atol=0)


@pytest.mark.parametrize("outlier", [False, True])
def test_mx_round_trip_bound(outlier: bool) -> None:
    block = 32
    w = (
        _weights_with_outlier(16, 96, block)
        if outlier
        else torch.randn(16, 96, generator=torch.Generator().manual_seed(4))
    )
    q, scales = quantize_mx(w, block)
    assert q.shape == w.shape and scales.shape == (16, 3)
    err = (w - dequantize_mx(q, scales, block)).abs()
    x = e8m0_to_float(scales).repeat_interleave(block, -1)
    # Within e4m3's range the half-ulp bound holds; amax / scale lies in [256, 512), so values
    # past 448 saturate (per the OCP spec) and lose exactly their excess over 448 * scale.
    bound = torch.maximum(w.abs() * E4M3_REL, x * E4M3_SUBNORMAL_ABS) * SLACK
    bound = torch.maximum(bound, w.abs() - FP8_MAX * x)
    assert (err <= bound).all()
    amax = w.abs().reshape(16, 3, block).amax(-1)
    assert (err.reshape(16, 3, block).amax(-1) <= amax / 4 * SLACK).all()


def test_int4_round_trip_within_half_a_step() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(5))
    s = int4_scales(w, 16)
    assert s.shape == (8, 4)
    torch.testing.assert_close(s, w.abs().reshape(8, 4, 16).amax(-1) / 7)
    err = (w - fake_quant_int4(w, 16)).abs()
    assert (err <= s.repeat_interleave(16, -1) * (0.5 + 1e-6)).all()
    levels = fake_quant_int4(w, 16).reshape(8, 4, 16) / s.unsqueeze(-1)
    torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_packed_equals_fake_quant_bit_for_bit(dtype: torch.dtype) -> None:
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(6)).to(dtype)
    w[0, :32] = 0.0  # a zero group
    w[1, 5] = -w[1, :32].abs().max()  # -amax sits on the grid at -7
    packed, scales = pack_int4(w, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (32, 128)
    assert scales.dtype == dtype and scales.shape == (32, 8)
    fq = fake_quant_int4(w, 32)
    up = unpack_int4(packed, scales, 32, dtype)
    assert torch.equal(up, fq)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(up.view(bits), fq.view(bits))  # also tells +0.0 from -0.0


def test_int4_nibble_layout() -> None:
    # Each row is one group with amax 7, so its scale is 1 and its codes are its values.
    w = torch.tensor([[-7.0, 7.0, -1.0, 0.0], [3.0, -2.0, 1.0, -7.0]])
    packed, scales = pack_int4(w, 4)
    assert torch.equal(scales, torch.ones(2, 1))
    # Low nibble = even column, two's complement: (-7, 7) -> 0x79, (-1, 0) -> 0x0F,
    # (3, -2) -> 0xE3, (1, -7) -> 0x91.
    assert packed.tolist() == [[0x79, 0x0F], [0xE3, 0x91]]
    assert torch.equal(unpack_int4(packed, scales, 4, torch.float32), w)
    # The extremes of the nibble range, written by hand: -8 is 0x8 and 7 is 0x7.
    hand = torch.tensor([[0x78, 0x0F]], dtype=torch.uint8)
    assert unpack_int4(hand, torch.ones(1, 1), 4, torch.float32).tolist() == [[-8, 7, -1, 0]]


def test_int4_fake_quant_gradient_is_identity() -> None:
    w = torch.randn(4, 32, requires_grad=True)
    upstream = torch.randn(4, 32)
    (fake_quant_int4(w, 8) * upstream).sum().backward()
    assert w.grad is not None and torch.equal(w.grad, upstream)


def _linear(k: int = 96, n: int = 48, bias: bool = True) -> nn.Linear:
    torch.manual_seed(7)
    return nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize(
    ("make", "tol"),
    [
        (lambda lin: FP8TrainLinear(lin, block=32), 0.06),
        (lambda lin: MXFP8TrainLinear(lin, block=32), 0.06),
        (lambda lin: Int4QATLinear(lin, group=32), 0.15),
    ],
    ids=["fp8", "mxfp8", "int4"],
)
def test_train_linear_matches_linear_and_trains(make: MakeLinear, tol: float) -> None:
    lin = _linear()
    mod = make(lin)
    assert mod.weight is lin.weight and mod.bias is lin.bias
    assert set(mod.state_dict()) == {"weight", "bias"}

    x = torch.randn(3, 5, 96, requires_grad=True)
    y = mod(x)
    ref = lin(x)
    rel = ((y - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < tol, rel

    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    gx, gw, gb = x.grad.clone(), lin.weight.grad.clone(), lin.bias.grad.clone()
    x.grad = None
    lin.zero_grad()
    (ref * upstream).sum().backward()
    # Straight-through: the same gradients as a plain linear, up to the quantized operands.
    for got, want in [(gx, x.grad), (gw, lin.weight.grad), (gb, lin.bias.grad)]:
        assert want is not None and ((got - want).norm() / want.norm()).item() < tol


def test_fp8_train_linear_bf16_weight_gets_bf16_grad() -> None:
    lin = _linear(bias=False).to(torch.bfloat16)
    mod = FP8TrainLinear(lin, block=32)
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    mod(x).float().sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(lin.weight.grad.float()).all()


def _tiny_qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


@pytest.mark.parametrize(
    "make",
    [
        lambda lin: FP8TrainLinear(lin, block=32),
        lambda lin: MXFP8TrainLinear(lin),
        lambda lin: Int4QATLinear(lin, group=32),
    ],
    ids=["fp8", "mxfp8", "int4"],
)
def test_convert_linears_on_tiny_qwen3(make: MakeLinear) -> None:
    model = _tiny_qwen3()
    names_before = set(model.state_dict())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    ref_loss = model(input_ids=ids, labels=ids).loss.item()

    n = convert_linears(model, make, skip=lambda name: name == "lm_head")
    assert n == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert type(model.lm_head) is nn.Linear
    assert not any(type(m) is nn.Linear for name, m in model.named_modules() if name != "lm_head")
    assert set(model.state_dict()) == names_before
    assert convert_linears(model, make, skip=lambda name: name == "lm_head") == 0

    out = model(input_ids=ids, labels=ids)
    assert abs(out.loss.item() - ref_loss) < 0.05 * ref_loss
    out.loss.backward()
    grads = [p.grad for name, p in model.named_parameters() if "proj" in name]
    assert len(grads) == 2 * 7 and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_convert_linears_without_skip_takes_lm_head_too() -> None:
    model = _tiny_qwen3()
    assert convert_linears(model, lambda lin: Int4QATLinear(lin, group=32)) == 2 * 7 + 1
    assert isinstance(model.lm_head, Int4QATLinear)
