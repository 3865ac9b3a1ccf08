"""Megatron-core on CPU ranks (gloo), for tests and checks only (`train.cpu_test_shims`).

megatron-core is written for CUDA. These shims let its forward and backward, its pipeline
schedules and its optimizer run on CPU: rotary embeddings, DDP grad buffers and pipeline
messages are placed at `torch.cuda.current_device()`, made "cpu"; the schedules and optimizers,
which name device="cuda" outright, see a `torch` whose tensor factories put "cuda" tensors on the
host; the CUDA RNG tracker is forked around dropout, made a no-op (dropout is 0 in every check);
and megatron-core 0.16's router names TransformerEngine's GEMM without defining it when TE is
absent (0.19 sets it to None).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


class _HostTorch:
    """`torch`, except that its tensor factories make device="cuda" tensors on the host."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(torch, name)
        return _on_host(attr) if name in _FACTORIES else attr


def _on_host(factory: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    return make


def run_megatron_on_cpu() -> None:
    """Patches this process's megatron-core so its models run on CPU. Call once, after
    `parallel_state.initialize_model_parallel` and before building a model."""
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *a, **k: None  # checkpoint writers wait on CUDA copies
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer import multi_latent_attention as mla

    for module in (schedules, optimizer, clip_grads, utils):
        module.torch = _HostTorch()
    if not isinstance(mla.TELinear, type):  # 0.16 without TE: a MagicMock that isinstance refuses
        mla.TELinear = type("NoTransformerEngine", (), {})
