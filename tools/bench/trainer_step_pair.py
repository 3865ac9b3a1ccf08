"""Benchmark: W0's train side on one GPU through one train backend, without engines or Ray.

The Qwen3-0.6B shape with random weights, bf16 compute, 64 sequences of a 64-token prompt and a
32-256-token response (seeded; 13,454 tokens), 8,192-token micro-batches; the old-logprob
forward (`logprobs`) and one `train_step` (loss -advantage x logprob), each timed on its own:
the first call of each (compiling, where a layer is compiled), then the median of 3. Also the
peak memory and the caching allocator's retries (a sign of memory pressure). One backend
configuration per process, so run it once per configuration in the same device call:

    python tools/bench/trainer_step_pair.py fsdp auto --out /tmp/pair.md
    python tools/bench/trainer_step_pair.py megatron off --profile --out /tmp/pair.md
    python tools/bench/trainer_step_pair.py megatron on --out /tmp/pair.md

Each appends one line (and with --profile, torch.profiler's top operators of one more step) to
--out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from plan_vs_measured import write_checkpoint
from train_step import w0_batch


def _trainer(backend: str, path: str, compile_mode: str) -> Any:
    if backend == "fsdp":
        from miles.precision.dtype import bf16
        from miles.torch.testing import make_trainer

        return make_trainer(
            path,
            master_port=29541,
            device="cuda",
            lr=1e-6,
            micro_batch_tokens=8192,
            dtype="bfloat16",
            compile=compile_mode,
            precision=bf16(),
        )
    from miles.megatron.testing import make_trainer as make_megatron

    return make_megatron(
        path, master_port=29542, device="cuda", lr=1e-6, micro_batch_tokens=8192,
        compile=compile_mode,
    )  # fmt: skip


def _timed(call: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    call()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("backend", choices=["fsdp", "megatron"])
    parser.add_argument("compile", choices=["auto", "on", "off"])
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("/tmp/trainer_step_pair.md"))
    args = parser.parse_args()

    def report(text: str) -> None:
        print(text, flush=True)
        with args.out.open("a") as f:
            f.write(text + "\n")

    tmp = tempfile.mkdtemp()
    write_checkpoint("Qwen/Qwen3-0.6B", None, Path(tmp))
    start = time.perf_counter()
    trainer = _trainer(args.backend, tmp, args.compile)
    build = time.perf_counter() - start
    batch = w0_batch(64, 320, varied=True)  # responses of 32-256 tokens

    def loss(inputs: Any) -> Any:
        return -inputs.advantages * inputs.logprobs, {}

    first = (
        _timed(lambda: trainer.logprobs(batch)),
        _timed(lambda: trainer.train_step(batch, loss)),
    )
    torch.cuda.reset_peak_memory_stats()
    logprob_s, train_s = [], []
    for _ in range(3):
        logprob_s.append(_timed(lambda: trainer.logprobs(batch)))
        train_s.append(_timed(lambda: trainer.train_step(batch, loss)))
    stats = torch.cuda.memory_stats()
    report(
        f"## {args.backend} compile={args.compile} ({torch.cuda.get_device_name()}): build "
        f"{build:.1f} s; first logprobs {first[0]:.2f} s train {first[1]:.2f} s; then logprobs "
        f"{statistics.median(logprob_s):.3f} s, train_step {statistics.median(train_s):.3f} s; "
        f"tokens {int(batch.seq_lens.sum())}; peak {torch.cuda.max_memory_allocated() / 1e9:.1f} "
        f"GB, reserved {torch.cuda.memory_reserved() / 1e9:.1f} GB, alloc retries "
        f"{stats.get('num_alloc_retries')}"
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            trainer.logprobs(batch)
            trainer.train_step(batch, loss)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            table = averages.table(sort_by=key, row_limit=25, max_name_column_width=70)
            report(f"```\n{table}\n```")
    trainer.close()


if __name__ == "__main__":
    main()
