"""Sampling for the paged path, on the device and without host syncs.

The same rules as `engine.sampler`: the logprob is log_softmax(logits / T) of the sampled token
over the whole vocabulary in fp32 (T = 1 for greedy rows); top-k, top-p and min-p only decide
which tokens may be drawn. What the batch needs (any sampled row, any filter, the widest top-k)
is decided on the host from the requests, so no step waits on the GPU to find out.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf

import torch

from miles.core.types import SamplingParams


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [rows] float32, 1 for greedy rows
    greedy: torch.Tensor  # [rows] bool
    top_k: torch.Tensor  # [rows] int64, vocab when off
    top_p: torch.Tensor  # [rows] float32
    min_p: torch.Tensor  # [rows] float32
    any_sampled: bool
    filtered: bool
    width: int  # candidates kept before top-p / min-p: max top-k, or the vocabulary

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device: torch.device) -> SamplingBatch:
        greedy = [p.temperature <= 0 for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        min_p = [p.min_p for p in params]
        filtered = any(k < vocab for k in top_k) or any(p.top_p < 1 for p in params) or any(min_p)
        return cls(
            temperature=torch.tensor(
                [1.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)],
                device=device,
            ),
            greedy=torch.tensor(greedy, device=device),
            top_k=torch.tensor(top_k, device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            min_p=torch.tensor(min_p, device=device, dtype=torch.float32),
            any_sampled=not all(greedy),
            filtered=filtered,
            width=max(top_k),
        )


def sample(
    logits: torch.Tensor, batch: SamplingBatch, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, logprobs), both [rows], from logits [rows, vocab]; nothing waits on the device."""
    logprobs = torch.log_softmax(logits.float() / batch.temperature.unsqueeze(1), dim=-1)
    tokens = logprobs.argmax(dim=-1)
    if batch.any_sampled:
        drawn = _draw(logprobs, batch, generator)
        tokens = torch.where(batch.greedy, tokens, drawn)
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _draw(logprobs: torch.Tensor, batch: SamplingBatch, generator: torch.Generator) -> torch.Tensor:
    """One token per row from the filtered distribution, by inverse CDF on one uniform draw."""
    ids = None
    candidates = logprobs
    if batch.filtered:
        candidates, ids = logprobs.topk(batch.width, dim=-1)  # sorted, largest first
        rank = torch.arange(batch.width, device=logprobs.device)
        candidates = candidates.masked_fill(rank >= batch.top_k.unsqueeze(1), -inf)
        probs = candidates.softmax(dim=-1)
        # Top-p over the top-k survivors renormalised; the top token always stays.
        drop = (probs.cumsum(dim=-1) - probs >= batch.top_p.unsqueeze(1)) & (rank > 0)
        # Min-p: tokens below min_p times the top token's probability.
        drop |= probs < batch.min_p.unsqueeze(1) * probs[:, :1]
        candidates = candidates.masked_fill(drop, -inf)
    cdf = candidates.exp().cumsum(dim=-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
    if ids is not None:
        drawn = ids.gather(1, drawn.unsqueeze(1)).squeeze(1)
    return drawn
