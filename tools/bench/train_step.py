"""Benchmark: the FSDP train step on one GPU: time, model FLOPs utilisation and peak memory
against the memory planner, over a sweep of `micro_batch_tokens`.

Workload: W0's trainer side (issue 19): the Qwen3-0.6B shape with random weights, bf16 compute,
`--samples` sequences of `--seq-len` tokens per step (W0: 64 x 320), no activation
checkpointing. Each row: the old-logprob forward and one train step (forward, backward, AdamW),
timed over `--steps` steps after one warm-up; peak memory (`torch.cuda.max_memory_allocated`)
over a step; the planner's train total for the same config. MFU: 8 x (matmul parameters: the
layers and the output head) x tokens per step / step time / the bf16 matmul rate measured in the
same call (6 for the train step's forward and backward, 2 for the old-logprob forward).

    python tools/bench/train_step.py --out /tmp/train_step.md
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from plan_vs_measured import write_checkpoint

GB = 1e9


def matmul_rate(n: int = 8192, repeats: int = 20) -> float:
    """bf16 FLOP/s of an n x n x n matmul, the best of `repeats`."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def planned_train_gb(path: str, micro_batch_tokens: int) -> float:
    from miles.core.config import parse
    from miles.runtime.planning.planner import plan

    run = parse(
        {
            "model": {"path": path},
            "data": {"path": "x.jsonl"},
            "precision": "bf16",
            "train": {"micro_batch_tokens": micro_batch_tokens, "dtype": "bfloat16"},
        }
    )
    return float(sum(plan(run).to_json()["train_gb"].values()))


def w0_batch(samples: int, seq_len: int, varied: bool) -> Any:
    """W0's train batch (seeded): `samples` sequences of a 64-token prompt and a response; varied:
    responses of 1/8 to all of the budget, as a rollout's are (the padded layout pays for the
    longest of each micro-batch); else every sequence is `seq_len` long. Advantages +-1."""
    from miles.core.contracts.types import PackedBatch, Sample

    rng = np.random.default_rng(0)
    lengths = (
        rng.integers((seq_len - 64) // 8, seq_len - 64 + 1, samples)
        if varied
        else np.full(samples, seq_len - 64)
    )
    return PackedBatch.from_samples(
        [
            Sample(
                prompt_ids=rng.integers(10, 150000, 64).tolist(),
                response_ids=rng.integers(10, 150000, int(n)).tolist(),
                sample_id=i,
            )
            for i, n in enumerate(lengths)
        ],
        advantages=[1.0 if i % 2 else -1.0 for i in range(samples)],
    )


def measure(
    path: str,
    micro_batch_tokens: int,
    samples: int,
    seq_len: int,
    steps: int,
    packing: str = "auto",
    varied: bool = False,
    profile: bool = False,
    compile_mode: str = "auto",
) -> dict:
    from miles.torch.testing import make_trainer

    trainer = make_trainer(
        path,
        master_port=29541,
        device="cuda",
        lr=1e-6,
        micro_batch_tokens=micro_batch_tokens,
        dtype="bfloat16",
        packing=packing,
        compile=compile_mode,
    )
    batch = w0_batch(samples, seq_len, varied)

    def loss(inputs: Any) -> Any:
        return -inputs.advantages * inputs.logprobs, {}

    def step() -> None:
        trainer.logprobs(batch)
        trainer.train_step(batch, loss)

    step()  # AdamW's state, kernels chosen
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / GB
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as profiler

        with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30), flush=True)
    trainer.close()
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "step_s": statistics.median(times),
        "peak_gb": peak,
        "tokens": int(batch.seq_lens.sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=320)
    parser.add_argument("--sweep", default="8192,16384,32768,65536")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--packing", default="auto", help="comma-separated: auto, off")
    parser.add_argument("--varied", action="store_true", help="response lengths vary (W0-like)")
    parser.add_argument("--profile", action="store_true", help="print a profile of each row")
    parser.add_argument("--compile", default="auto", help="comma-separated: auto, off")
    parser.add_argument("--out", default="/tmp/train_step.md")
    args = parser.parse_args()
    rate = matmul_rate()
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        config = write_checkpoint(args.checkpoint, None, Path(tmp))
        layers = config["num_hidden_layers"]
        hidden, inter, vocab = (
            config["hidden_size"],
            config["intermediate_size"],
            config["vocab_size"],
        )
        heads, kv, head_dim = (
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config.get("head_dim") or hidden // config["num_attention_heads"],
        )
        per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter
        matmul_params = layers * per_layer + vocab * hidden
        # Train step: 6 flops per parameter and token; the old-logprob forward: 2 more.
        flops_per_token = 8 * matmul_params
        lines += [
            f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; bf16 matmul "
            f"measured now: {rate / 1e12:.0f} TFLOP/s; {args.checkpoint} shape, "
            f"{matmul_params / 1e6:.0f}M matmul parameters; {args.samples} x {args.seq_len} "
            f"tokens per step (more when a micro-batch needs them); old-logprob forward + train step",
            "",
            "| packing | compile | micro_batch_tokens | tokens / step | step s | MFU "
            "| peak GB (measured) | planned GB | planned / measured |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rows = [
            (packing, mode, int(mbt))
            for packing in args.packing.split(",")
            for mode in args.compile.split(",")
            for mbt in args.sweep.split(",")
        ]
        for packing, mode, mbt in rows:
            # Enough sequences that the micro-batch is full (the plan assumes it is).
            samples = max(args.samples, -(-mbt // args.seq_len))
            r = measure(
                tmp, mbt, samples, args.seq_len, args.steps, packing, args.varied,
                args.profile, mode,
            )  # fmt: skip
            gc.collect()
            torch.cuda.empty_cache()
            plan_gb = planned_train_gb(tmp, mbt)
            lines.append(
                f"| {packing} | {mode} | {mbt} | {r['tokens']} | {r['step_s']:.3f} | "
                f"{100 * flops_per_token * r['tokens'] / r['step_s'] / rate:.0f}% | "
                f"{r['peak_gb']:.1f} | {plan_gb:.1f} | {plan_gb / r['peak_gb']:.2f} |"
            )
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
