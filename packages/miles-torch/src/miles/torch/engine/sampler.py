"""Per-row sampling from next-token logits, and the logprob RL needs for each sampled token."""

from __future__ import annotations

from dataclasses import dataclass
from math import inf

import torch

from miles.core.types import SamplingParams


@dataclass
class SamplingTensors:
    """The sampling parameters of the rows of a batch, as [rows] tensors on the model's device."""

    temperature: torch.Tensor  # float32; 0 means greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; <= 0 means off
    min_p: torch.Tensor  # float32; 0 means off

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device) -> SamplingTensors:
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device, dtype=torch.int64),
            min_p=torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32),
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[rows], self.top_p[rows], self.top_k[rows], self.min_p[rows]
        )

    @staticmethod
    def cat(parts: list[SamplingTensors]) -> SamplingTensors:
        return SamplingTensors(
            *(
                torch.cat([getattr(p, f) for p in parts])
                for f in ("temperature", "top_p", "top_k", "min_p")
            )
        )


def sample(
    logits: torch.Tensor, params: SamplingTensors, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [rows, vocab]; return (tokens, logprobs), both [rows].

    The logprob is log_softmax(logits / T) of the chosen token over the *unfiltered* vocabulary
    (T = 1 for greedy rows), in fp32: the behaviour-policy probability the trainer compares with.
    top-k and top-p only decide which tokens may be drawn.
    """
    logits = logits.float()
    greedy = params.temperature <= 0
    temp = torch.where(greedy, 1.0, params.temperature).unsqueeze(1)
    logprobs_all = torch.log_softmax(logits / temp, dim=-1)

    tokens = logits.argmax(dim=-1)
    if not bool(greedy.all()):
        candidates, ids = _top_k_top_p(logprobs_all, params)
        drawn = _draw(candidates, generator)
        if ids is not None:
            drawn = ids.gather(1, drawn.unsqueeze(1)).squeeze(1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)


def _top_k_top_p(
    logprobs: torch.Tensor, params: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's candidates: (logprobs with -inf for excluded tokens, their token ids).

    ids is None when nothing is filtered (candidates = the whole vocabulary, in order). Top-p is
    taken over the top-k survivors renormalised, as in Hugging Face and vLLM. When every row
    has a top-k, only the top max(k) are sorted: a full-vocabulary sort is slow on CPU.
    """
    vocab, top_k, top_p = logprobs.shape[-1], params.top_k, params.top_p
    k_on = (top_k > 0) & (top_k < vocab)
    min_p = params.min_p
    if not bool(k_on.any()) and bool((top_p >= 1).all()) and not bool((min_p > 0).any()):
        return logprobs, None
    width = int(top_k.max()) if bool(k_on.all()) else vocab
    candidates, ids = logprobs.topk(width, dim=-1)  # sorted, largest first
    rank = torch.arange(width, device=logprobs.device)
    candidates = candidates.masked_fill(rank >= torch.where(k_on, top_k, vocab).unsqueeze(1), -inf)
    probs = candidates.softmax(dim=-1)
    # Keep a token while the mass before it is < p; the top token always stays.
    drop = (probs.cumsum(dim=-1) - probs >= top_p.unsqueeze(1)) & (rank > 0)
    drop |= probs < min_p.unsqueeze(1) * probs[:, :1]  # min-p: relative to the top token
    return candidates.masked_fill(drop, -inf), ids


def _draw(logprobs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One index per row from exp(logprobs) by inverse CDF: one uniform draw per row.

    (Cheaper than Gumbel/exponential noise over the whole vocabulary, which is slow on CPU.)
    Zero-probability entries own an empty CDF interval, so they are never drawn.
    """
    cdf = logprobs.exp().cumsum(dim=-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
