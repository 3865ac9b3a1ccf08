# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
"""The chunked head's softmax arithmetic fused into Triton kernels, on CUDA.

Forward: one pass over each row of a chunk's logits (in the head's dtype) gives its log-sum-exp,
the target's logprob and the entropy of softmax(logits / T) (online softmax). Backward: one more
pass writes d(loss)/d(logits) over the logits, in place. The torch path in `chunked_head` makes
about ten passes over fp32 copies of the same logits; the numbers are the same up to the order
of the sums.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_BLOCK = 4096


def available(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dim() == 2


def softmax_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, logprob of each row's target, entropy), fp32 [rows], of softmax(logits / T)."""
    rows, vocab = logits.shape
    logits = logits.contiguous()
    lse, logprobs, entropy = (
        torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    if rows:
        _stats_kernel[(rows,)](
            logits, targets.contiguous(), lse, logprobs, entropy, vocab, float(temperature),
            BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return lse, logprobs, entropy


def logits_grad_(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """Overwrites contiguous `logits` [rows, vocab] with the gradient of
    sum(grad_logprobs * logprob + grad_entropy * entropy) with respect to them; returns it."""
    rows, vocab = logits.shape
    assert logits.is_contiguous()
    if rows:
        _grad_kernel[(rows,)](
            logits, targets.contiguous(), lse.contiguous(), entropy.contiguous(),
            grad_logprobs.float().contiguous(), grad_entropy.float().contiguous(),
            vocab, float(temperature), BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
    return logits


if triton is not None:

    @triton.jit
    def _stats_kernel(
        logits_ptr, target_ptr, lse_ptr, logprob_ptr, entropy_ptr, vocab, t,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * vocab
        cols = tl.arange(0, BLOCK)
        m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)  # sum of exp(z - m)
        sz = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)  # sum of exp(z - m) * z
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            valid = offs < vocab
            z = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) / t
            new_m = tl.maximum(m, tl.max(z, axis=0))
            e = tl.exp(z - new_m)
            alpha = tl.exp(m - new_m)
            s = s * alpha + tl.sum(e, axis=0)
            sz = sz * alpha + tl.sum(tl.where(valid, e * z, 0.0), axis=0)
            m = new_m
        lse = m + tl.log(s)
        target_logit = tl.load(base + tl.load(target_ptr + row)).to(tl.float32) / t
        tl.store(lse_ptr + row, lse)
        tl.store(logprob_ptr + row, target_logit - lse)
        tl.store(entropy_ptr + row, lse - sz / s)

    @triton.jit
    def _grad_kernel(
        logits_ptr, target_ptr, lse_ptr, entropy_ptr, grad_logprob_ptr, grad_entropy_ptr,
        vocab, t, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * vocab
        cols = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        g_logprob = tl.load(grad_logprob_ptr + row)
        g_entropy = tl.load(grad_entropy_ptr + row)
        target = tl.load(target_ptr + row)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            valid = offs < vocab
            z = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) / t
            logp = z - lse
            p = tl.exp(logp)
            # d logprob / dz = onehot(target) - p;  d entropy / dz = -p * (logp + entropy)
            grad = -p * (g_logprob + g_entropy * (logp + entropy))
            grad = tl.where(offs == target, grad + g_logprob, grad) / t
            tl.store(base + offs, grad.to(logits_ptr.dtype.element_ty), mask=valid)
