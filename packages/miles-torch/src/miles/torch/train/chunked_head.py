"""The logprob and entropy of each target token straight from the last hidden states, a chunk
of tokens at a time, so a micro-batch never holds its [tokens, vocab] logits in fp32 (nor their
log-softmax, its exp or their gradients) at once.

The forward keeps the hidden states, the head's weight and one log-sum-exp per token; the
backward computes each chunk's logits again. The arithmetic is the plain path's: logits in the
head's dtype, then fp32 (log-softmax over logits / T); only the sums over chunks of the weight's
gradient are added in fp32 rather than inside one matmul. On CUDA the softmax arithmetic of a
chunk is one Triton pass forward and one backward (`head_kernel`); elsewhere it is torch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles.torch.train import head_kernel
from miles.torch.train.config import LOGIT_CHUNK_ELEMENTS

CHUNK_ELEMENTS = LOGIT_CHUNK_ELEMENTS  # (a module global: tests shrink it)


def chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _chunks(n: int, vocab: int) -> list[slice]:
    chunk = chunk_tokens(vocab)
    return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _scaled_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """fp32 logits / T of one chunk, from logits in the head's dtype (as the plain path)."""
    return logits.float() / temperature


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        for c in _chunks(hidden.shape[0], weight.shape[0]):
            logits = F.linear(hidden[c], weight, bias)
            stats = head_kernel.softmax_stats if head_kernel.available(logits) else _softmax_stats
            lse[c], logprobs[c], entropy[c] = stats(logits, targets[c], temperature)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        # The weight's (and bias') gradient summed over chunks in fp32; only what is wanted.
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        )
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if want_b
            else None
        )
        for c in _chunks(hidden.shape[0], weight.shape[0]):
            logits = F.linear(hidden[c], weight, bias)
            grad_of = head_kernel.logits_grad_ if head_kernel.available(logits) else _logits_grad
            g = grad_of(
                logits, targets[c], lse[c], entropy[c], grad_logprobs[c], grad_entropy[c],
                temperature,
            ).to(hidden.dtype)  # fmt: skip
            if grad_h is not None:
                grad_h[c] = g @ weight
            if grad_w is not None:
                grad_w += (g.t() @ hidden[c]).float()
            if grad_b is not None:
                grad_b += g.float().sum(dim=0)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
        )


def _softmax_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, logprob of each target, entropy), fp32, of softmax(logits / T) of a chunk."""
    z = _scaled_logits(logits, temperature)
    lse = torch.logsumexp(z, dim=-1)
    logprobs = z.gather(1, targets[:, None]).squeeze(1) - lse
    return lse, logprobs, lse - (torch.exp(z - lse[:, None]) * z).sum(dim=-1)


def _logits_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """fp32 d(sum(grad_logprobs * logprob + grad_entropy * entropy)) / d(logits) of a chunk."""
    logp = _scaled_logits(logits, temperature) - lse[:, None]
    p = torch.exp(logp)
    # d logp[t] / dz = onehot(t) - p;  d entropy / dz = -p * (logp + entropy)
    grad_z = -p * (grad_logprobs[:, None] + grad_entropy[:, None] * (logp + entropy[:, None]))
    grad_z[torch.arange(len(grad_z), device=grad_z.device), targets] += grad_logprobs
    return grad_z / temperature


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), fp32 [tokens], of log_softmax((hidden @ weight.T + bias) / T) at
    `targets`, for hidden [tokens, hidden_size]."""
    out: tuple[torch.Tensor, torch.Tensor] = _ChunkedLogprobs.apply(
        hidden, weight, bias, targets, temperature
    )
    return out
