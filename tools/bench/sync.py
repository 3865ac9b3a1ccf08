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

`--disaggregated` (issue 24) benchmarks the other transport instead: the trainer (FSDP, bf16
precision) on GPU 0 and the engine on GPU 1 in a process of its own, the weights broadcast over
the NCCL sync group a disaggregated run uses (`join_weight_sync`, `send_weights` on the trainer,
`receive_weights` on the engine). A sync ends when the engine says its weights are loaded, as a
run's does; both sides' checksums must then agree. Against it, in the same call and on the same
two GPUs: a plain `torch.distributed.broadcast` of one bucket-sized buffer, many times over.
`--cpu` runs the same code over gloo on CPU with a tiny shape (a smoke run, not a measurement).

    python tools/bench/sync.py --disaggregated --shape 4b --bucket-mb 64,128,256,512,1024
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
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
    # --cpu's default: a few MB of weights, enough for several buckets of 1 MB.
    "tiny": dict(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
}
# The plain broadcast moves about this many bytes per bucket size (at least 10 broadcasts).
PLAIN_BYTES = {"cuda": 16 * 2**30, "cpu": 256 * 2**20}
TARGET = 0.70  # of the plain broadcast (issue 24)


def engine_side(path: str, requests: Any, replies: Any, device: str = "cuda") -> None:
    from miles.torch.engine.engine import TorchRolloutEngine

    if torch.device(device).index is not None:
        # Kernels launched without a device (checksum, copies) must land on the engine's GPU.
        torch.cuda.set_device(torch.device(device))
    engine = TorchRolloutEngine(path, device=device, dtype="bfloat16", path="hf")
    replies.put(("ready", None))
    while True:
        kind, payload = requests.get()
        if kind == "bucket":
            plan, index, handle = payload
            t = time.perf_counter()
            engine.load_bucket(plan, index, handle)  # returns after the copies finished
            replies.put(("loaded", time.perf_counter() - t))
        elif kind == "checksum":
            _synchronize(engine.device)
            t = time.perf_counter()
            checksum = engine.weights_checksum()
            replies.put(("checksum", (checksum, time.perf_counter() - t)))
        elif kind == "profile":
            with _profiler() as prof:
                engine.weights_checksum()
            print("engine checksum:\n" + _table(prof), flush=True)
        elif kind == "join":  # disaggregated: rank 1 of the sync group
            host, port = payload
            engine.join_weight_sync(host, port, 2, 1)
            replies.put(("joined", None))
        elif kind == "receive":
            plan, version = payload
            t = time.perf_counter()
            engine.receive_weights(plan, version)
            _synchronize(engine.device)  # loaded, not only queued
            replies.put(("received", time.perf_counter() - t))
        elif kind == "leave":
            engine.leave_weight_sync()
            replies.put(("left", None))
        else:
            return


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _profiler() -> Any:
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def _table(prof: Any) -> str:
    return str(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default=None, help="default 0.6b (tiny with --cpu)"
    )
    parser.add_argument("--bucket-mb", default="512", help="comma-separated sizes")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="/tmp/sync.md")
    parser.add_argument("--profile", action="store_true", help="print where one round's time goes")
    parser.add_argument(
        "--disaggregated",
        action="store_true",
        help="trainer on GPU 0, engine on GPU 1, weights over the NCCL sync group",
    )
    parser.add_argument(
        "--cpu", action="store_true", help="with --disaggregated: a gloo smoke run on CPU"
    )
    parser.add_argument(
        "--device-check",
        action="store_true",
        help="only check that --disaggregated has its 2 GPUs, then exit",
    )
    args = parser.parse_args()
    if args.cpu and not args.disaggregated:
        parser.error("--cpu needs --disaggregated (the colocated mode shares a GPU by CUDA IPC)")
    args.shape = args.shape or ("tiny" if args.cpu else "0.6b")
    if args.device_check:
        print(require_two_gpus())
        return
    if args.disaggregated:
        if args.profile:
            parser.error("--profile is for the colocated mode")
        disaggregated(args)
    else:
        colocated(args)


def colocated(args: argparse.Namespace) -> None:
    from miles.torch.testing import make_tiny_model, make_trainer

    bandwidth = hbm_bandwidth()
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(tmp, **shape)
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


def _reply(replies: Any, engine: Any) -> tuple[str, Any]:
    """The engine's next reply; an error, not a hang, if its process died."""
    while True:
        try:
            return replies.get(timeout=5)  # type: ignore[no-any-return]
        except queue.Empty:
            if not engine.is_alive():
                raise RuntimeError(
                    f"the engine process died (exit code {engine.exitcode}); its traceback is above"
                ) from None


def require_two_gpus() -> str:
    """The GPUs the disaggregated mode runs on, or exit with one line saying what is missing."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < 2:
        sys.exit(
            f"sync.py --disaggregated needs 2 GPUs (trainer on cuda:0, engine on cuda:1); "
            f"found {found}. Use --disaggregated --cpu for a gloo smoke run."
        )
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(2))
    return f"ok: {found} GPUs; using cuda:0 and cuda:1 ({names})"


def _broadcast_rank(rank: int, port: int, sizes: list[int], cpu: bool, out: Any) -> None:
    """One rank of the plain broadcast: a default process group of two, one buffer per size."""
    device = torch.device("cpu") if cpu else torch.device("cuda", rank)
    if not cpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "gloo" if cpu else "nccl",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
    )
    fence = torch.zeros(1, device=device)

    def started_together() -> None:
        # Rank 1 can finish this broadcast only once rank 0 reached it.
        dist.broadcast(fence, src=0)
        _synchronize(device)

    rates: dict[int, float] = {}
    for size in sizes:
        # bf16, as the sync's buckets (the byte count is what matters to the link).
        buffer = torch.empty(size // 2, dtype=torch.bfloat16, device=device)
        iterations = max(10, PLAIN_BYTES[device.type] // size)
        for _ in range(3):  # warm-up: the first one sets up the communicator
            dist.broadcast(buffer, src=0)
        started_together()
        t = time.perf_counter()
        for _ in range(iterations):
            dist.broadcast(buffer, src=0)
        _synchronize(device)
        rates[size] = buffer.nbytes * iterations / (time.perf_counter() - t) / 1e9
        del buffer
    if rank == 1:  # the receiver's clock: its last broadcast ends when the bytes are in
        out.put(rates)
    dist.destroy_process_group()


def plain_broadcast_gbps(sizes: list[int], cpu: bool) -> dict[int, float]:
    """GB/s of `torch.distributed.broadcast` from rank 0 (GPU 0) to rank 1 (GPU 1), per size
    in bytes, in two processes of their own (run before the trainer and engine start)."""
    from miles.runtime.cluster.process import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_broadcast_rank, args=(r, port, sizes, cpu, out)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        rates: dict[int, float] = out.get(timeout=600)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    return rates


def disaggregated(args: argparse.Namespace) -> None:
    from miles.precision.dtype import bf16
    from miles.runtime.cluster.process import free_port
    from miles.torch.testing import make_tiny_model, make_trainer

    where = "gloo on CPU (smoke run)" if args.cpu else require_two_gpus()
    trainer_device, engine_device = ("cpu", "cpu") if args.cpu else ("cuda:0", "cuda:1")
    trainer_dev = torch.device(trainer_device)
    sizes = [int(x) for x in args.bucket_mb.split(",")]
    # First, while both GPUs have nothing else on them.
    plain = plain_broadcast_gbps([mb * 2**20 for mb in sizes], args.cpu)
    shape = SHAPES[args.shape]
    table: list[str] = []
    met: list[tuple[int, bool]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(tmp, **shape)
        ctx = mp.get_context("spawn")
        requests, replies = ctx.Queue(), ctx.Queue()
        engine = ctx.Process(target=engine_side, args=(path, requests, replies, engine_device))
        engine.start()
        trainer = None
        try:
            trainer = make_trainer(
                path,
                master_port=free_port(),
                device=trainer_device,
                dtype="bfloat16",
                precision=bf16(),
            )
            assert _reply(replies, engine)[0] == "ready"
            # As the weight updater builds the group: the engine joins while rank 0's store
            # waits for it.
            port = free_port()
            requests.put(("join", ("127.0.0.1", port)))
            trainer.join_weight_sync("127.0.0.1", port, 2)
            assert _reply(replies, engine)[0] == "joined"
            version = 0
            for bucket_mb in sizes:
                plan = trainer.weight_sync_plan(bucket_mb * 2**20)
                sends: list[float] = []
                gbps: list[float] = []
                produce: list[float] = []
                for round_ in range(args.repeats + 1):
                    # The trainer's share alone: gather each full tensor and convert it, no
                    # packing, no link.
                    _synchronize(trainer_dev)
                    t = time.perf_counter()
                    for _ in trainer.weights.rollout_weights():
                        pass
                    _synchronize(trainer_dev)
                    produce.append(time.perf_counter() - t)
                    # One sync as the weight updater does it: the engine is told to receive,
                    # the trainer sends, and it is over when the engine has loaded every bucket.
                    version += 1
                    requests.put(("receive", (plan, version)))
                    t = time.perf_counter()
                    sent = trainer.send_weights(plan)
                    kind, _ = _reply(replies, engine)
                    sends.append(time.perf_counter() - t)
                    assert kind == "received", kind
                    gbps.append(sent / sends[-1] / 1e9)
                    requests.put(("checksum", None))
                    mine = trainer.weights_checksum("bfloat16")
                    _, (theirs, _) = _reply(replies, engine)
                    if theirs != mine:
                        raise RuntimeError(
                            f"verification failed at {bucket_mb} MB, round {round_}: the engine's "
                            f"checksum {theirs[:16]} is not the trainer's {mine[:16]}"
                        )
                rows = slice(1, None)  # the first round warms up (and sets up NCCL)
                ours = statistics.median(gbps[rows])
                share = ours / plain[bucket_mb * 2**20]
                met.append((bucket_mb, share >= TARGET))
                table.append(
                    f"| {args.shape} | {sent / 1e9:.3g} GB | {bucket_mb} MB x "
                    f"{len(plan.buckets)} | {statistics.median(sends[rows]):.4f} | {ours:.3g} | "
                    f"yes ({args.repeats}/{args.repeats}) | {plain[bucket_mb * 2**20]:.3g} | "
                    f"{100 * share:.0f}% | {statistics.median(produce[rows]):.4f} |"
                )
                print(table[-1], flush=True)
            requests.put(("leave", None))
            assert _reply(replies, engine)[0] == "left"
            trainer.leave_weight_sync()
        finally:
            requests.put(("stop", None))
            engine.join(timeout=60)
            if engine.is_alive():  # stuck in a broadcast whose peer is gone
                engine.kill()
            if trainer is not None:
                trainer.close()
    good = ", ".join(f"{mb} MB" for mb, ok in met if ok) or "no bucket size"
    bad = ", ".join(f"{mb} MB" for mb, ok in met if not ok)
    verdict = f"met at {good}" + (f"; NOT met at {bad}" if bad else "")
    nccl = ""
    if not args.cpu:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    text = "\n".join(
        [
            f"Disaggregated weight sync, trainer {trainer_device} -> engine {engine_device}: "
            f"{where}; torch {torch.__version__}" + (f", NCCL {nccl}" if nccl else ""),
            f"Median of {args.repeats} rounds after one warm-up. Transfer: from the trainer's "
            "send until the engine reports every bucket loaded. Plain broadcast: "
            "torch.distributed.broadcast of one bucket-sized bf16 buffer, same two devices.",
            "",
            "| shape | sync bytes | buckets | transfer s | GB/s loaded | verified "
            "| plain broadcast GB/s | % of plain | of the transfer: trainer gather + convert "
            "alone s |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|",
            *table,
            "",
            f"Target: >= {100 * TARGET:.0f}% of the plain broadcast: {verdict}.",
        ]
    )
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
