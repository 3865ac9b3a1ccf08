"""Vocabulary-parallel logprobs on TP gloo CPU ranks against one rank's full-vocabulary
log-softmax: values and gradients. Usage: python vocab_parallel_check.py TP; prints JSON."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from cpu_ranks import report, spawn_and_print

from miles.megatron import logprobs as vp

VOCAB, PADDED, HIDDEN, TOKENS, T = 300, 512, 32, 70, 0.7


def reference(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logp = torch.log_softmax(h @ w[:VOCAB].t() / T, dim=-1)
    lp = logp.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _run(rank: int, tp: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64)
    w = torch.randn(PADDED, HIDDEN, generator=g, dtype=torch.float64)
    w[VOCAB:] = 0  # Megatron's padding rows
    targets = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    a, b = (
        torch.randn(TOKENS, generator=g, dtype=torch.float64),
        torch.randn(TOKENS, generator=g, dtype=torch.float64),
    )

    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_ref, ent_ref = reference(hr, wr, targets)
    ((lp_ref * a + ent_ref * b).sum()).backward()

    rows = PADDED // tp
    hs = h.clone().requires_grad_()
    ws = w[rank * rows : (rank + 1) * rows].clone().requires_grad_()
    vp.CHUNK_ELEMENTS = 17 * rows  # several chunks, the last one short
    lp, ent = vp.vocab_parallel_logprobs(
        hs,
        ws,
        targets,
        vocab_start=rank * rows,
        vocab_size=VOCAB,
        temperature=T,
        group=dist.group.WORLD,
    )
    ((lp.double() * a + ent.double() * b).sum()).backward()
    assert (
        hs.grad is not None and ws.grad is not None and hr.grad is not None and wr.grad is not None
    )
    pairs = {
        "logprob": (lp.double(), lp_ref),
        "entropy": (ent.double(), ent_ref),
        "grad_hidden": (hs.grad, hr.grad),
        "grad_weight": (ws.grad, wr.grad[rank * rows : (rank + 1) * rows]),
    }
    # Max abs error over the reference's max abs (the function computes in fp32; this is fp64).
    result: dict[str, float] = {"rank": rank}
    for name, (ours, ref) in pairs.items():
        result[name] = (
            ((ours - ref).abs().max() / wr.grad.abs().max().clamp(min=1e-12)).item()
            if name == "grad_weight"
            else ((ours - ref).abs().max() / ref.abs().max()).item()
        )
    report(rank, result)
    dist.destroy_process_group()


if __name__ == "__main__":
    tp = int(sys.argv[1])
    spawn_and_print(_run, args=(tp, int(os.environ.get("MILES_TEST_PORT", "29571"))), nprocs=tp)
