"""Benchmark: colocated weight sync on one GPU, against the HBM copy bandwidth measured in the
same call (a device copy moves B bytes at half the copy bandwidth, which counts the read and the
write).

A trainer process (FSDP, bf16 precision: weights go out in bf16) and an engine process (the native engine, bf16) share one
GPU, as in a colocated run with nothing offloaded. The trainer packs each bucket of its sync plan
and shares it through CUDA IPC (`send_weights_in_place`); the engine maps it and copies it into
its weights (`load_bucket`): the code a run uses, with a pipe instead of Ray between the two.
Then both sides compute the weight checksum that verification compares. Reported, median of
`--repeats`: transfer time and GB/s, checksum time on each side.

    python tools/bench/sync.py --out /tmp/sync.md [--shape 4b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from engine_decode import QWEN3_06B, hbm_bandwidth

SHAPES = {
    "0.6b": QWEN3_06B,
    "4b": {
        **QWEN3_06B,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
    },
}


def engine_side(path: str, requests: Any, replies: Any) -> None:
    from miles.torch.engine.engine import TorchRolloutEngine

    engine = TorchRolloutEngine(path, device="cuda", dtype="bfloat16", path="hf")
    replies.put(("ready", None))
    while True:
        kind, payload = requests.get()
        if kind == "bucket":
            plan, index, handle = payload
            t = time.perf_counter()
            engine.load_bucket(plan, index, handle)  # returns after the copies finished
            replies.put(("loaded", time.perf_counter() - t))
        elif kind == "checksum":
            torch.cuda.synchronize()
            t = time.perf_counter()
            checksum = engine.weights_checksum()
            replies.put(("checksum", (checksum, time.perf_counter() - t)))
        elif kind == "profile":
            with _profiler() as prof:
                engine.weights_checksum()
            print("engine checksum:\n" + _table(prof), flush=True)
        else:
            return


def _profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _table(prof: Any) -> str:
    return str(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--bucket-mb", default="512", help="comma-separated sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="/tmp/sync.md")
    parser.add_argument("--profile", action="store_true", help="print where one round's time goes")
    args = parser.parse_args()
    from miles.torch.testing import make_tiny_model, make_trainer

    bandwidth = hbm_bandwidth()
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(tmp, vocab_size=shape["vocab_size"], **{
            k: v for k, v in shape.items() if k != "vocab_size"
        })  # fmt: skip
        ctx = mp.get_context("spawn")
        requests, replies = ctx.Queue(), ctx.Queue()
        engine = ctx.Process(target=engine_side, args=(path, requests, replies))
        engine.start()
        from miles.precision.dtype import bf16

        trainer = make_trainer(
            path, master_port=29547, device="cuda", dtype="bfloat16", precision=bf16()
        )
        assert replies.get()[0] == "ready"
        table = []
        for bucket_mb in [int(x) for x in args.bucket_mb.split(",")]:
            plan = trainer.weight_sync_plan(bucket_mb * 2**20)

            loads: list[float] = []

            def deliver(index: int, handle: Any, plan: Any = plan, loads: Any = loads) -> None:
                requests.put(("bucket", (plan, index, handle)))
                kind, seconds = replies.get()
                assert kind == "loaded"
                loads[-1] += seconds

            sends, gbps, ours, theirs, packs = [], [], [], [], []
            for _ in range(args.repeats + 1):
                # Where the transfer's time goes: packing alone (no engine), then the engine's
                # share of the full round trips (open, copy in, synchronize).
                torch.cuda.synchronize()
                t = time.perf_counter()
                trainer.send_weights_in_place(plan, None)
                torch.cuda.synchronize()
                packs.append(time.perf_counter() - t)
                loads.append(0.0)
                torch.cuda.synchronize()
                t = time.perf_counter()
                sent = trainer.send_weights_in_place(plan, deliver)
                sends.append(time.perf_counter() - t)
                gbps.append(sent / sends[-1] / 1e9)
                requests.put(("checksum", None))
                t = time.perf_counter()
                mine = trainer.weights_checksum("bfloat16")
                ours.append(time.perf_counter() - t)
                _, (checksum, seconds) = replies.get()
                theirs.append(seconds)
                assert checksum == mine, "the engine holds other weights than the trainer"
            rows = slice(1, None)  # the first round warms up
            table.append(
                f"| {args.shape} | {sent / 1e9:.2f} GB | {bucket_mb} MB x {len(plan.buckets)} | "
                f"{statistics.median(sends[rows]):.3f} | {statistics.median(gbps[rows]):.0f} | "
                f"{100 * statistics.median(gbps[rows]) * 1e9 / (bandwidth / 2):.0f}% | "
                f"{statistics.median(ours[rows]):.3f} | {statistics.median(theirs[rows]):.3f} | "
                f"{statistics.median(packs[rows]):.3f} | {statistics.median(loads[rows]):.3f} |"
            )
            print(table[-1], flush=True)
            if args.profile:
                with _profiler() as prof:
                    trainer.send_weights_in_place(plan, deliver)
                    torch.cuda.synchronize()
                print("trainer send (the engine's loads inside):\n" + _table(prof), flush=True)
                requests.put(("profile", None))
        requests.put(("stop", None))
        engine.join()
        trainer.close()
    text = "\n".join(
        [
            f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}; HBM copy "
            f"bandwidth measured now: {bandwidth / 1e12:.2f} TB/s",
            "",
            "| shape | sync bytes | buckets | transfer s | GB/s | % of a device copy "
            "| trainer checksum s | engine checksum s | of the transfer: packing alone s "
            "| engine's load s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *table,
        ]
    )
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
