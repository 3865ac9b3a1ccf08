"""Per-row sampling from next-token logits, and the logprob RL needs for each sampled token.

Both generation loops (hf and paged) sample here. What a batch needs (any sampled row, any
filter, the widest top-k, any seed) is decided on the host when the batch is built, so sampling
never waits on the device to find out. After `select` or `cat` those facts are kept as upper
bounds, which is safe: a filter that keeps every token changes nothing.

A request with `SamplingParams.seed` draws the uniform for its n-th response token from a
counter-based hash of (seed, n) instead of the engine's generator, so it samples the same tokens
whatever it is batched with, on either path, and after a preemption.

Penalties, structured-output masks and logit biases change the logits before they get here
(`logits`), so the logprobs are those of the distribution the row samples from.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf

import torch

from miles.core.contracts.types import SamplingParams
from miles.torch.engine import sample_kernel
from miles.torch.int_hash import mix32

NO_SEED = -1


@dataclass
class SamplingTensors:
    """The sampling parameters of the rows of a batch, as [rows] tensors on the model's device,
    and host-side facts about them."""

    temperature: torch.Tensor  # float32; 0 means greedy
    top_p: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; <= 0 means off
    min_p: torch.Tensor  # float32; 0 means off
    seed: torch.Tensor  # int64; NO_SEED: the engine's generator
    all_greedy: bool = False
    top_k_range: tuple[int, int] | None = None  # smallest and largest top-k of rows with one
    top_k_everywhere: bool = False  # every row has a top-k
    p_filters: bool = False  # some row has top_p < 1 or min_p > 0
    seeded: bool = False
    # Host-side flags of the per-request extras (`logits`): only batches with such a row pay.
    penalized: bool = False  # some row has a frequency, presence or repetition penalty
    constrained: bool = False  # some row has a structured-output constraint
    biased: bool = False  # some row has a logit_bias
    top_logprobs: int = 0  # the largest SamplingParams.top_logprobs of the rows

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device) -> SamplingTensors:
        ks = [p.top_k for p in params if p.top_k > 0]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], device=device),
            top_p=torch.tensor([p.top_p for p in params], device=device),
            top_k=torch.tensor([p.top_k for p in params], device=device, dtype=torch.int64),
            min_p=torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32),
            seed=torch.tensor(
                [NO_SEED if p.seed is None else p.seed for p in params],
                device=device,
                dtype=torch.int64,
            ),
            all_greedy=all(p.temperature <= 0 for p in params),
            top_k_range=(min(ks), max(ks)) if ks else None,
            top_k_everywhere=bool(params) and len(ks) == len(params),
            p_filters=any(p.top_p < 1 or p.min_p > 0 for p in params),
            seeded=any(p.seed is not None for p in params),
            penalized=any(p.penalized for p in params),
            constrained=any(p.constraint is not None for p in params),
            biased=any(p.logit_bias for p in params),
            top_logprobs=max((p.top_logprobs for p in params), default=0),
        )

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(
            self.temperature[rows],
            self.top_p[rows],
            self.top_k[rows],
            self.min_p[rows],
            self.seed[rows],
            self.all_greedy,
            self.top_k_range,
            self.top_k_everywhere,
            self.p_filters,
            self.seeded,
            self.penalized,
            self.constrained,
            self.biased,
            self.top_logprobs,
        )

    @staticmethod
    def cat(parts: list[SamplingTensors]) -> SamplingTensors:
        ranges = [p.top_k_range for p in parts if p.top_k_range is not None]

        def joined(field: str) -> torch.Tensor:
            return torch.cat([getattr(p, field) for p in parts])

        return SamplingTensors(
            temperature=joined("temperature"),
            top_p=joined("top_p"),
            top_k=joined("top_k"),
            min_p=joined("min_p"),
            seed=joined("seed"),
            all_greedy=all(p.all_greedy for p in parts),
            top_k_range=(min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None,
            top_k_everywhere=all(p.top_k_everywhere for p in parts),
            p_filters=any(p.p_filters for p in parts),
            seeded=any(p.seeded for p in parts),
            penalized=any(p.penalized for p in parts),
            constrained=any(p.constrained for p in parts),
            biased=any(p.biased for p in parts),
            top_logprobs=max((p.top_logprobs for p in parts), default=0),
        )


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    generator: torch.Generator,
    counters: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits` [rows, vocab]; return (tokens, logprobs), both [rows].

    The logprob is log_softmax(logits / T) of the chosen token over the *unfiltered* vocabulary
    (T = 1 for greedy rows), in fp32: the behaviour-policy probability the trainer compares with.
    top-k, top-p and min-p only decide which tokens may be drawn. `counters` [rows] (int64):
    each row's response length so far, which seeded rows need. Nothing waits on the device.
    """
    greedy = params.temperature <= 0
    temp = torch.where(greedy, 1.0, params.temperature)
    # Constrained rows take the torch path: the kernel's online softmax does not take a block
    # of logits that are all -inf (a structured-output mask).
    fused = not (_filters(params, logits.shape[-1]) or params.constrained)
    if fused and sample_kernel.available(logits):
        # One fused kernel: no [rows, vocab] fp32 intermediates, a few passes over the logits.
        if params.all_greedy:
            u = torch.zeros(logits.shape[0], device=logits.device)
        else:
            u = _uniforms(params, generator, counters)
        return sample_kernel.fused_sample(logits, temp, greedy, u)
    logprobs_all = torch.log_softmax(logits.float() / temp.unsqueeze(1), dim=-1)
    tokens = logprobs_all.argmax(dim=-1)
    if not params.all_greedy:
        candidates, ids = _top_k_top_p(logprobs_all, params)
        drawn = _draw(candidates, _uniforms(params, generator, counters))
        if ids is not None:
            drawn = ids.gather(1, drawn.unsqueeze(1)).squeeze(1)
        tokens = torch.where(greedy, tokens, drawn)
    return tokens, logprobs_all.gather(1, tokens.unsqueeze(1)).squeeze(1)


def top_k_logprobs(
    logits: torch.Tensor, params: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, token ids), both [rows, k] with k = the batch's largest top_logprobs (at most
    the vocabulary), most likely first: of the distribution `sample`'s logprobs come from,
    log_softmax(logits / T) with T = 1 for greedy rows, filters not applied. Rows that asked
    for fewer keep the first ones."""
    greedy = params.temperature <= 0
    temp = torch.where(greedy, 1.0, params.temperature).unsqueeze(1)
    k = min(params.top_logprobs, logits.shape[-1])
    values, ids = torch.log_softmax(logits.float() / temp, dim=-1).topk(k, dim=-1)
    return values, ids


def _filters(params: SamplingTensors, vocab: int) -> bool:
    """Whether top-k, top-p or min-p may drop a token of some row."""
    k_range = params.top_k_range
    return (k_range is not None and k_range[0] < vocab) or params.p_filters


def _top_k_top_p(
    logprobs: torch.Tensor, params: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's candidates: (logprobs with -inf for excluded tokens, their token ids).

    ids is None when nothing is filtered (candidates = the whole vocabulary, in order). Top-p is
    taken over the top-k survivors renormalised, as in Hugging Face and vLLM; min-p drops tokens
    below min_p times the top token's probability. When every row has a top-k, only the top
    max(k) are sorted: a full-vocabulary sort is slow.
    """
    vocab, top_k = logprobs.shape[-1], params.top_k
    k_range = params.top_k_range
    if not _filters(params, vocab):
        return logprobs, None
    width = min(k_range[1], vocab) if k_range is not None and params.top_k_everywhere else vocab
    candidates, ids = logprobs.topk(width, dim=-1)  # sorted, largest first
    rank = torch.arange(width, device=logprobs.device)
    k_on = (top_k > 0) & (top_k < vocab)
    candidates = candidates.masked_fill(rank >= torch.where(k_on, top_k, vocab).unsqueeze(1), -inf)
    probs = candidates.softmax(dim=-1)
    # Keep a token while the mass before it is < p; the top token always stays.
    drop = (probs.cumsum(dim=-1) - probs >= params.top_p.unsqueeze(1)) & (rank > 0)
    drop |= probs < params.min_p.unsqueeze(1) * probs[:, :1]
    return candidates.masked_fill(drop, -inf), ids


def _uniforms(
    params: SamplingTensors, generator: torch.Generator, counters: torch.Tensor | None
) -> torch.Tensor:
    """One uniform in [0, 1) per row: from the generator, or from (seed, counter) for seeded rows."""
    u = torch.rand((params.seed.shape[0],), generator=generator, device=params.seed.device)
    if not params.seeded:
        return u
    if counters is None:
        raise ValueError("seeded rows need their response lengths (counters) to sample")
    return torch.where(params.seed != NO_SEED, seeded_uniform(params.seed, counters), u)


def _draw(logprobs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One index per row from exp(logprobs) by inverse CDF at the row's uniform `u` [rows].

    (Cheaper than Gumbel/exponential noise over the whole vocabulary, which is slow on CPU.)
    Zero-probability entries own an empty CDF interval, so they are never drawn.
    """
    cdf = logprobs.exp().cumsum(dim=-1)
    target = u.unsqueeze(1).to(cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)


def seeded_uniform(seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """A uniform float32 in [0, 1) that depends only on (seed, counter), both int64 >= 0."""
    h = mix32(seed)
    h = mix32(h ^ (seed >> 32))
    h = mix32(h ^ counter)
    return (h >> 8).to(torch.float32) / float(1 << 24)
