"""Low-precision formats as precision components: one object converts the training model and,
on every sync, the weights into the rollout engine's format.

- training: every projection `nn.Linear` (`*_proj`: attention and dense MLPs) becomes the
  format's training linear (fp8 blockwise with `torch._scaled_mm`, emulated mxfp8, or int4
  fake-quant with a straight-through estimator). Embeddings, norms, the LM head, routers and
  fused MoE experts stay in the compute dtype.
- sync: each such weight travels quantized, with its scales beside it
  (`x.weight` + `x.weight_scale_inv` for fp8, `x.weight` + `x.weight_scale` for mxfp8 and int4).
- engines without the matching kernel decode the pair back to their dtype (`RolloutDecoder`);
  the engine reports which it did.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from miles.precision.config import Compute, Int4QATConfig, QuantConfig
from miles.precision.formats import fp8, int4, mxfp8
from miles.precision.formats.linear import (
    FP8TrainLinear,
    Int4QATLinear,
    MXFP8TrainLinear,
    convert_linears,
)


def is_projection(name: str) -> bool:
    """The modules a low-precision format converts: attention and MLP projections."""
    return name.rsplit(".", 1)[-1].endswith("_proj")


def _quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith("_proj.weight") and tensor.dim() == 2


class QuantizedPrecision:
    """A precision component for one low-precision format (see the module docstring)."""

    def __init__(
        self,
        name: str,
        compute: Compute,
        make_linear: Callable[[torch.nn.Linear], torch.nn.Module],
        encode: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        decode: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor],
        scale_suffix: str,
        describe: str,
    ) -> None:
        self.name, self.dtype = name, getattr(torch, compute)
        self.rollout_dtype: str = compute
        self._make_linear, self._encode, self._decode = make_linear, encode, decode
        self.scale_suffix, self.describe = scale_suffix, describe

    # ── training ─────────────────────────────────────────────────────────────────────────────

    def convert_model(self, model: torch.nn.Module) -> int:
        """Swaps the model's projection Linears for this format's training linears (same
        parameters, so names and checkpoints are unchanged); returns how many."""
        return convert_linears(model, self._make_linear, skip=lambda n: not is_projection(n))

    # ── sync ─────────────────────────────────────────────────────────────────────────────────

    def convert_for_rollout(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            if _quantized_weight(name, tensor):
                quantized, scale = self._encode(tensor.detach().float())
                yield name, quantized
                yield name + self.scale_suffix, scale
            elif tensor.is_floating_point():
                yield name, tensor.to(self.dtype)
            else:
                yield name, tensor

    def rollout_decoder(self, dtype: torch.dtype) -> RolloutDecoder:
        return RolloutDecoder(self, dtype)

    def decode(
        self, quantized: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return self._decode(quantized, scale, dtype)


class RolloutDecoder:
    """Engine side, for engines without the format's kernel: pairs each quantized weight with its
    scales (they may arrive in different buckets, or different calls) and yields the weight in
    the engine's dtype. Everything else passes through."""

    def __init__(self, precision: QuantizedPrecision, dtype: torch.dtype) -> None:
        self.precision, self.dtype = precision, dtype
        self._waiting: dict[str, torch.Tensor] = {}  # weight or scale, until its partner comes

    @property
    def report(self) -> str:
        return f"{self.precision.describe}, dequantized to {str(self.dtype).removeprefix('torch.')}"

    def __call__(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        suffix = self.precision.scale_suffix
        for name, tensor in named_tensors:
            if name.endswith(suffix):
                weight_name = name.removesuffix(suffix)
            elif name.endswith("_proj.weight") and (
                tensor.dtype in _FP8 or not tensor.is_floating_point()
            ):  # a quantized weight: fp8 codes, or packed int4 bytes
                weight_name = name
            else:
                yield name, tensor
                continue
            other = name + suffix if weight_name == name else weight_name
            if other not in self._waiting:
                self._waiting[name] = tensor.clone()  # bucket memory is reused after this call
                continue
            partner = self._waiting.pop(other)
            weight, scale = (tensor, partner) if weight_name == name else (partner, tensor)
            yield weight_name, self.precision.decode(weight, scale, self.dtype)


_FP8 = (torch.float8_e4m3fn,)


def fp8_precision(config: QuantConfig) -> QuantizedPrecision:
    return QuantizedPrecision(
        "fp8",
        config.compute,
        FP8TrainLinear,
        lambda w: fp8.quantize_blockwise(w),
        lambda q, s, dtype: fp8.dequantize_blockwise(q, s, dtype=dtype),
        "_scale_inv",
        "fp8 e4m3, 128x128 block scales",
    )


def mxfp8_precision(config: QuantConfig) -> QuantizedPrecision:
    return QuantizedPrecision(
        "mxfp8",
        config.compute,
        MXFP8TrainLinear,
        lambda w: mxfp8.quantize_mx(w),
        lambda q, s, dtype: mxfp8.dequantize_mx(q, s, dtype=dtype),
        "_scale",
        "mxfp8 e4m3, 1x32 blocks with e8m0 scales",
    )


def int4_qat_precision(config: Int4QATConfig) -> QuantizedPrecision:
    group = config.group_size

    def encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return int4.pack_int4(w, group)

    return QuantizedPrecision(
        "int4-qat",
        config.compute,
        lambda linear: Int4QATLinear(linear, group),
        encode,
        lambda q, s, dtype: int4.unpack_int4(q, s, group, torch.float32).to(dtype),
        "_scale",
        f"int4 symmetric, group {group}, weight-only",
    )
