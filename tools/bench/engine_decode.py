"""Benchmark: the paged engine's decode and prefill speed on one GPU, next to the bandwidth floor.

Workload: a random-weight Qwen3-0.6B shape (28 layers, hidden 1024, 16 heads, 8 KV heads, head
dim 128, vocab 151,936, tied embeddings) in bf16. For each batch size and context, the engine
prefills `batch` prompts of `context` tokens, then decodes; decode steps are timed after a
warm-up. The floor of one decode step is the bytes it must read (every weight once, plus each
row's K/V) over the HBM bandwidth measured by a device-to-device copy in the same process.

    python tools/bench/engine_decode.py --out /tmp/engine_decode.md
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.engine.sampler import sample
from miles.torch.testing import make_tiny_model

QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    max_position_embeddings=40960,
    initializer_range=0.02,
)


def hbm_bandwidth(gib: float = 4.0, repeats: int = 20) -> float:
    """Bytes/s of a device-to-device copy (read + write), the best of `repeats`."""
    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * n * 2 / best


def bench(engine: TorchRolloutEngine, batch: int, context: int, decode_steps: int) -> dict | None:
    runner = engine._paged
    assert runner is not None
    if batch * runner.pool.pages_for(context + decode_steps + 32) > runner.pool.num_pages - 1:
        return None  # the cache cannot hold every row at once: preemption would be timed
    g = torch.Generator().manual_seed(batch * 7 + context)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=decode_steps + 32)
    requests = [
        GenerateRequest(i, torch.randint(200, 150000, (context,), generator=g).tolist(), sampling)
        for i in range(batch)
    ]
    seqs = runner.add(requests)
    torch.cuda.synchronize()
    t = time.perf_counter()
    while any(s.num_uncomputed > 1 or not s.response for s in seqs):
        runner.step()
    torch.cuda.synchronize()
    prefill_s = time.perf_counter() - t
    warmup = 3
    for _ in range(warmup):
        runner.step()
    torch.cuda.synchronize()
    made = len(seqs[0].response)
    t = time.perf_counter()
    calls = 0
    # A call may run several decode steps (rollout.decode_burst): count the tokens made.
    while all(s.finish_reason is None for s in seqs) and calls < decode_steps:
        runner.step()
        calls += 1
    torch.cuda.synchronize()
    steps = len(seqs[0].response) - made
    step_s = (time.perf_counter() - t) / max(steps, 1)
    parts = {"replay_s": float("nan"), "sample_s": float("nan")}
    if runner.graphs is not None:  # the step's parts: the graph replay alone, sampling alone
        size = next(s for s in runner.graphs.sizes if s >= batch)
        parts["replay_s"] = timed(runner.graphs.graphs[size].replay)
        logits = runner.graphs.outputs[size][:batch]
        params = runner._sampling(seqs)
        parts["sample_s"] = timed(lambda: sample(logits, params, runner.generator))
    runner.abort([s for s in seqs if s.finish_reason is None])
    return {"prefill_s": prefill_s, "step_s": step_s, "steps": steps, **parts}


def timed(fn: Any, repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="/tmp/engine_decode.md")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--decode-steps", type=int, default=64)
    parser.add_argument("--no-graphs", action="store_true")
    args = parser.parse_args()
    bandwidth = hbm_bandwidth()
    path = make_tiny_model(tempfile.mkdtemp(), vocab_size=QWEN3_06B["vocab_size"], **{
        k: v for k, v in QWEN3_06B.items() if k != "vocab_size"
    })  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    settings = TorchEngineConfig(
        page_size=16,
        max_batch_size=max(batches),
        max_context=max(contexts) + args.decode_steps + 48,
        max_prefill_tokens=32768,
        mem_fraction=0.92,
        cuda_graphs=not args.no_graphs,
    )
    engine = TorchRolloutEngine(
        path, device="cuda", dtype="bfloat16", max_batch_size=max(batches), path="paged",
        paged=settings,
    )  # fmt: skip
    engine._eos_ids = frozenset()  # every row decodes to its limit, as W0's random model does
    model = engine._paged.model  # type: ignore[union-attr]
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * 2
    lines = [
        f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; HBM copy bandwidth "
        f"measured now: {bandwidth / 1e12:.2f} TB/s; weights {weight_bytes / 1e9:.2f} GB (bf16); "
        f"CUDA graphs: {settings.cuda_graphs}",
        "",
        "| batch | context | decode step (ms) | graph replay (ms) | sampling (ms) | tokens/s "
        "| floor (ms) | % of floor | prefill tokens/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for context in contexts:
        for batch in batches:
            r = bench(engine, batch, context, args.decode_steps)
            if r is None:
                lines.append(f"| {batch} | {context} | does not fit in the KV cache | | | | | | |")
                continue
            floor = (
                weight_bytes + batch * (context + args.decode_steps // 2) * kv_token
            ) / bandwidth
            lines.append(
                f"| {batch} | {context} | {r['step_s'] * 1e3:.2f} | {r['replay_s'] * 1e3:.2f} | "
                f"{r['sample_s'] * 1e3:.2f} | {batch / r['step_s']:,.0f} | "
                f"{floor * 1e3:.2f} | {100 * floor / r['step_s']:.0f}% | "
                f"{batch * context / r['prefill_s']:,.0f} |"
            )
            print(lines[-1], flush=True)
    graphs = engine._paged.graphs  # type: ignore[union-attr]
    if graphs is not None:
        lines.append(
            f"\n{len(graphs.graphs)} decode graphs captured (one per batch size used) "
            f"in {graphs.capture_s:.1f} s"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
