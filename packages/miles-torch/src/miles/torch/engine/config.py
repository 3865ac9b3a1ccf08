"""The typed config section of the `torch` rollout backend. No torch import: listing stays cheap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EnginePath = Literal["auto", "paged", "hf"]


@dataclass
class TorchEngineConfig:
    # Weight and compute dtype; null (the default): the run's precision decides ("float32" for
    # fp32, "bfloat16" for bf16 and the quantized formats' default compute).
    dtype: str | None = None
    # Most sequences decoded together; more queue and join as others finish.
    max_batch_size: int = 64
    # Which generation loop runs:
    # - paged: a KV cache allocated once in pages, packed prefill, paged attention, prompts
    #   shared by a group's samples and cached for later turns, CUDA graphs on GPU. For
    #   Llama-shaped families (Llama, Qwen2, Qwen3, Qwen3-MoE) with full attention.
    # - hf: transformers' model forward with its own cache, continuous batching by rows. Every
    #   family.
    # - auto: paged on a GPU where the model and run allow it, else hf (the engine logs which
    #   path it runs and why).
    path: EnginePath = "auto"
    # Paged path: tokens per KV page.
    page_size: int = 16
    # Paged path on GPU: the share of the device's memory the engine's weights and KV cache
    # may take (SGLang's mem_fraction_static).
    mem_fraction: float = 0.85
    # Paged path: the KV cache's size in tokens (null: max_batch_size x max_context, or less
    # when mem_fraction of the GPU cannot hold that). The memory plan counts this size.
    kv_cache_tokens: int | None = None
    # Paged path: the longest prompt + response a request may have.
    max_context: int = 4096
    # Paged path: tokens one prefill step computes at most (longer prompts prefill in chunks).
    max_prefill_tokens: int = 8192
    # Paged path on GPU: capture decode steps as CUDA graphs.
    cuda_graphs: bool = True
    # Paged path: decode steps run back to back before the host reads the sampled tokens (a
    # row that stops inside a burst drops the tokens it sampled after its stop).
    decode_burst: int = 8

    def __post_init__(self) -> None:
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.path not in ("auto", "paged", "hf"):
            raise ValueError(f"path must be auto, paged or hf, got {self.path!r}")
        for name in (
            "max_batch_size",
            "page_size",
            "max_context",
            "max_prefill_tokens",
            "decode_burst",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.mem_fraction <= 1:
            raise ValueError(f"mem_fraction must be in (0, 1], got {self.mem_fraction}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError(
                f"kv_cache_tokens must hold at least one page ({self.page_size} tokens), "
                f"got {self.kv_cache_tokens}"
            )
