"""Logprobs and entropy of target tokens from a vocabulary-parallel output layer, a chunk of
tokens at a time: no rank ever holds the full vocabulary's logits, and no rank holds its own
vocabulary shard's logits in fp32 for more than one chunk.

Each tensor rank has rows [start, start + V/tp) of the (padded) output weight. Per chunk, the
softmax statistics are reduced over the tensor group: the max, then in one all-reduce the sum of
exp, the sum of exp * logit (for the entropy) and the target's logit (from the rank that holds
it). Rows past the real vocabulary (Megatron's padding) are left out. The backward computes the
chunk's logits again; the hidden states' gradient is summed over the group, as Megatron's
column-parallel layer does for its input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Elements of one chunk's local logits (fp32): 64 Mi elements is 256 MB.
CHUNK_ELEMENTS = 64 * 1024 * 1024


def _chunks(n: int, local_vocab: int) -> list[slice]:
    step = max(1, CHUNK_ELEMENTS // local_vocab)
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def _all_reduce(t: torch.Tensor, op: Any, group: Any) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        vocab_start: int,
        vocab_size: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = hidden.shape[0]
        real = max(0, min(weight.shape[0], vocab_size - vocab_start))  # local rows that are real
        local_targets = targets - vocab_start
        mine = (local_targets >= 0) & (local_targets < real)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy, lse = torch.empty_like(logprobs), torch.empty_like(logprobs)
        for c in _chunks(n, weight.shape[0]):
            z = F.linear(hidden[c], weight[:real]).float() / temperature
            peak = z.max(dim=-1).values if real else z.new_full((z.shape[0],), -torch.inf)
            peak = _all_reduce(peak, dist.ReduceOp.MAX, group)
            e = torch.exp(z - peak[:, None])
            idx = local_targets[c].clamp(0, max(real - 1, 0))
            target = (
                z.gather(1, idx[:, None]).squeeze(1) if real else z.new_zeros(len(idx))
            ) * mine[c]
            sums = torch.stack([e.sum(-1), (e * z).sum(-1), target])
            sums = _all_reduce(sums, dist.ReduceOp.SUM, group)
            lse[c] = peak + sums[0].log()
            logprobs[c] = sums[2] - lse[c]
            entropy[c] = lse[c] - sums[1] / sums[0]
        ctx.save_for_backward(hidden, weight, local_targets, mine, lse, entropy)
        ctx.temperature, ctx.real, ctx.group = temperature, real, group
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx: Any, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, local_targets, mine, lse, entropy = ctx.saved_tensors
        temperature, real = ctx.temperature, ctx.real
        grad_h = torch.zeros_like(hidden, dtype=torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for c in _chunks(hidden.shape[0], weight.shape[0]):
            if not real:
                break
            logp = F.linear(hidden[c], weight[:real]).float() / temperature - lse[c, None]
            p = torch.exp(logp)
            gl, ge = grad_logprobs[c, None], grad_entropy[c, None]
            # d logp[t]/dz = onehot(t) - p;  d entropy/dz = -p * (logp + entropy)
            g = -p * (gl + ge * (logp + entropy[c, None]))
            # The one-hot term, on this rank's targets only: a masked scatter (no host sync).
            idx = local_targets[c].clamp(0, real - 1)[:, None]
            g.scatter_add_(1, idx, (grad_logprobs[c] * mine[c])[:, None].to(g.dtype))
            # The matmuls in the weights' dtype (bf16 on GPUs, as fsdp's head), the weight's
            # gradient summed over chunks in fp32.
            g = (g / temperature).to(hidden.dtype)
            grad_h[c] += g @ weight[:real]
            grad_w[:real] += (g.t() @ hidden[c]).float()
        grad_h = _all_reduce(grad_h, dist.ReduceOp.SUM, ctx.group)
        return grad_h.to(hidden.dtype), grad_w.to(weight.dtype), None, None, None, None, None


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    temperature: float = 1.0,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), fp32 [tokens], of softmax(hidden @ W.T / T) over the real vocabulary
    at `targets` (global token ids), where this rank's `weight` holds the output rows from
    `vocab_start` and `group` is the tensor-parallel group (None: one rank holds them all).
    `hidden` [tokens, hidden_size] is the same on every rank of the group."""
    out: tuple[torch.Tensor, torch.Tensor] = _VocabParallelLogprobs.apply(
        hidden, weight, targets, temperature, vocab_start, vocab_size, group
    )
    return out
