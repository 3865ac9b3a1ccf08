# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
"""Unfiltered sampling fused into one Triton kernel: temperature, log-softmax, the inverse-CDF
draw, the argmax of greedy rows and the sampled token's logprob, in two passes over each row's
logits and without materialising the fp32 log-probabilities of the whole vocabulary.

The arithmetic is `sampler.sample`'s (fp32, logprob = log_softmax(logits / T)[token]); only the
order of the sums differs, so a uniform that falls within rounding of a CDF boundary may pick
the neighbouring token. Rows with top-k, top-p or min-p, and batches with a structured-output
constraint (whose masked logits are -inf, which the online softmax does not take), take the
torch path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def available(logits: torch.Tensor) -> bool:
    return triton is not None and logits.is_cuda and logits.dim() == 2


def fused_sample(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64, logprobs fp32), both [rows]: greedy rows take the argmax, the others the
    inverse CDF of softmax(logits / T) at `u`; `temperature` is 1 for greedy rows."""
    rows, vocab = logits.shape
    logits = logits.contiguous()
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _sample_kernel[(rows,)](
            logits,
            temperature.float().contiguous(),
            greedy.to(torch.int8),
            u.float().contiguous(),
            tokens,
            logprobs,
            vocab,
            BLOCK=4096,
            num_warps=8,
        )
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _sample_kernel(
        logits_ptr, temp_ptr, greedy_ptr, u_ptr, token_ptr, logprob_ptr, vocab,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * vocab
        t = tl.load(temp_ptr + row)
        cols = tl.arange(0, BLOCK)
        # Pass 1: the running max and sum of exp (online softmax), and the first argmax.
        m = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        best = m
        best_index = tl.sum(tl.zeros((BLOCK,), tl.int64), axis=0)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) / t
            block_max = tl.max(x, axis=0)
            block_arg = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int64) + start
            better = block_max > best
            best_index = tl.where(better, block_arg, best_index)
            best = tl.maximum(best, block_max)
            new_m = tl.maximum(m, block_max)
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
            m = new_m
        # Pass 2: the first token whose CDF exceeds u x total (searchsorted, right=True).
        target = tl.load(u_ptr + row) * s
        acc = tl.sum(tl.zeros((BLOCK,), tl.float32), axis=0)
        chosen = tl.sum(tl.zeros((BLOCK,), tl.int64), axis=0) + vocab
        last = tl.sum(tl.zeros((BLOCK,), tl.int64), axis=0)  # last token with mass (rounding)
        for start in range(0, vocab, BLOCK):
            offs = start + cols
            valid = offs < vocab
            x = tl.load(base + offs, mask=valid, other=float("-inf")).to(tl.float32) / t
            p = tl.exp(x - m)
            cdf = tl.cumsum(p, axis=0) + acc
            hit = (cdf > target) & valid
            chosen = tl.minimum(chosen, tl.min(tl.where(hit, offs, vocab), axis=0).to(tl.int64))
            last = tl.maximum(last, tl.max(tl.where((p > 0) & valid, offs, 0), axis=0).to(tl.int64))
            acc += tl.sum(p, axis=0)
        chosen = tl.where(chosen < vocab, chosen, last)
        token = tl.where(tl.load(greedy_ptr + row) != 0, best_index, chosen)
        logit = tl.load(base + token).to(tl.float32) / t
        tl.store(token_ptr + row, token)
        tl.store(logprob_ptr + row, logit - m - tl.log(s))
