"""The logprob and entropy of each target token straight from the last hidden states, a chunk
of tokens at a time, so a micro-batch never holds its [tokens, vocab] logits in fp32 (nor their
log-softmax, its exp or their gradients) at once.

The forward keeps the hidden states, the head's weight and one log-sum-exp per token; the
backward computes each chunk's logits again. The arithmetic is the plain path's: logits in the
head's dtype, then fp32 (log-softmax over logits / T); only the sums over chunks of the weight's
gradient are added in fp32 rather than inside one matmul.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles.torch.train.config import LOGIT_CHUNK_ELEMENTS

CHUNK_ELEMENTS = LOGIT_CHUNK_ELEMENTS  # (a module global: tests shrink it)


def chunk_tokens(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab)


def _chunks(n: int, vocab: int) -> list[slice]:
    chunk = chunk_tokens(vocab)
    return [slice(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def _scaled_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """fp32 logits / T of one chunk, the head's matmul in its own dtype (as the plain path)."""
    return F.linear(hidden, weight, bias).float() / temperature


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
            z = _scaled_logits(hidden[c], weight, bias, temperature)
            lse[c] = torch.logsumexp(z, dim=-1)
            logprobs[c] = z.gather(1, targets[c, None]).squeeze(1) - lse[c]
            entropy[c] = lse[c] - (torch.exp(z - lse[c, None]) * z).sum(dim=-1)
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
            logp = _scaled_logits(hidden[c], weight, bias, temperature) - lse[c, None]
            p = torch.exp(logp)
            # d logp[t] / dz = onehot(t) - p;  d entropy / dz = -p * (logp + entropy)
            grad_z = -p * (
                grad_logprobs[c, None] + grad_entropy[c, None] * (logp + entropy[c, None])
            )
            grad_z[torch.arange(len(grad_z), device=grad_z.device), targets[c]] += grad_logprobs[c]
            g = (grad_z / temperature).to(hidden.dtype)
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
