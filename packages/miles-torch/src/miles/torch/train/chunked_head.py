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
        n, chunk = hidden.shape[0], chunk_tokens(weight.shape[0])
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = F.linear(hidden[s:e], weight, bias).float() / temperature
            lse[s:e] = torch.logsumexp(z, dim=-1)
            logprobs[s:e] = z.gather(1, targets[s:e, None]).squeeze(1) - lse[s:e]
            p = torch.exp(z - lse[s:e, None])
            entropy[s:e] = lse[s:e] - (p * z).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        n, chunk = hidden.shape[0], chunk_tokens(weight.shape[0])
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        rows = torch.arange(chunk, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            z = F.linear(hidden[s:e], weight, bias).float() / temperature
            logp = z - lse[s:e, None]
            p = torch.exp(logp)
            # d logp[t] / dz = onehot(t) - p;  d entropy / dz = -p * (logp + entropy)
            grad_z = -p * (
                grad_logprobs[s:e, None] + grad_entropy[s:e, None] * (logp + entropy[s:e, None])
            )
            grad_z[rows[: e - s], targets[s:e]] += grad_logprobs[s:e]
            g = (grad_z / temperature).to(hidden.dtype)
            if grad_h is not None:
                grad_h[s:e] = g @ weight
            if want_w:
                grad_w += (g.t() @ hidden[s:e]).float()
            if want_b:
                grad_b += g.float().sum(dim=0)
        return (
            grad_h,
            grad_w.to(weight.dtype) if want_w else None,
            grad_b.to(bias.dtype) if want_b else None,
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
