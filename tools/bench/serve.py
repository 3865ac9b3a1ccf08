"""Benchmark: `miles serve` under N concurrent clients against the same engine in-process.

For each concurrency N: N client threads each send `--requests` /generate calls one after
another (token ids in, `max_new_tokens` out, temperature 1, logprobs returned) to a `miles serve`
process on 127.0.0.1; the same prompts then go through the engine in-process (`generate` on
batches of N, one call per round). Reported: requests/s and generated tokens/s, p50/p99 latency
per request, and the HTTP overhead: the median latency of one request at N=1 over HTTP minus
in-process.

    python tools/bench/serve.py --out /tmp/serve.md            # the CPU twin
    python tools/bench/serve.py --device cuda --out /tmp/serve.md
    python tools/bench/serve.py --engine-path paged          # the paged path on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


def over_http(url: str, clients: int, per_client: int, length: int, vocab: int, new: int) -> dict:
    latencies: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def client(seed: int) -> None:
        for prompt in prompts(per_client, length, vocab, seed):
            body = {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": new, "temperature": 1.0},
                "return_logprob": True,
            }
            t = time.perf_counter()
            out = post(url + "/generate", body)
            with lock:
                latencies.append(time.perf_counter() - t)
                tokens[0] += len(out["output_ids"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summary(latencies, tokens[0], time.perf_counter() - t0)


def in_process(
    engine: Any, clients: int, per_client: int, length: int, vocab: int, new: int
) -> dict:
    from miles.core.contracts.types import GenerateRequest, SamplingParams

    batches = [prompts(per_client, length, vocab, seed) for seed in range(clients)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
    latencies: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    for round_ in range(per_client):
        requests = [GenerateRequest(i, batches[i][round_], sampling) for i in range(clients)]
        t = time.perf_counter()
        results = list(engine.results(requests))
        latencies += [time.perf_counter() - t] * clients
        tokens += sum(len(r.response_ids) for r in results)
    return summary(latencies, tokens, time.perf_counter() - t0)


def summary(latencies: list[float], tokens: int, seconds: float) -> dict:
    ordered = sorted(latencies)
    return {
        "requests_s": len(latencies) / seconds,
        "tokens_s": tokens / seconds,
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=8, help="per client")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256, help="the twin's width")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--engine-path", default="auto", choices=["auto", "paged", "hf"])
    parser.add_argument("--out", default="/tmp/serve.md")
    args = parser.parse_args()

    from miles.runtime.cluster.process import free_port
    from miles.torch.engine.engine import TorchRolloutEngine
    from miles.torch.testing import make_tiny_model

    vocab = 1024
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(
            Path(tmp) / "model", vocab_size=vocab, hidden_size=args.hidden,
            intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
        )  # fmt: skip
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "miles.core.cli", "serve", model, "--port", str(port),
             "--device", args.device, "--dtype", dtype, "--engine-path", args.engine_path],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            post(url + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
            engine = TorchRolloutEngine(
                model, device=args.device, dtype=dtype, path=args.engine_path
            )
            engine.results([])  # nothing: keeps the first real call's timing fair
            lines = [
                f"`miles serve` vs in-process, {args.device} ({engine.path} path), a "
                f"{args.layers}-layer {args.hidden}-wide Qwen3 twin (vocab {vocab}, {dtype}); prompts of "
                f"{args.prompt_len} tokens, up to {args.new_tokens} new tokens at T=1, "
                f"{args.requests} requests per client",
                "",
                "| clients | HTTP req/s | in-process req/s | HTTP tok/s | in-process tok/s "
                "| HTTP p50 s | HTTP p99 s | in-process p50 s |",
                "|---:|---:|---:|---:|---:|---:|---:|---:|",
            ]
            one: dict[str, float] = {}
            for n in [int(c) for c in args.concurrency.split(",")]:
                h = over_http(url, n, args.requests, args.prompt_len, vocab, args.new_tokens)
                e = in_process(engine, n, args.requests, args.prompt_len, vocab, args.new_tokens)
                if n == 1:
                    one = {"http": h["p50"], "engine": e["p50"]}
                lines.append(
                    f"| {n} | {h['requests_s']:.1f} | {e['requests_s']:.1f} | "
                    f"{h['tokens_s']:.0f} | {e['tokens_s']:.0f} | {h['p50']:.3f} | "
                    f"{h['p99']:.3f} | {e['p50']:.3f} |"
                )
                print(lines[-1], flush=True)
            if one:
                lines += [
                    "",
                    f"HTTP overhead per request (N=1, median): "
                    f"{1000 * (one['http'] - one['engine']):.1f} ms",
                ]
        finally:
            server.terminate()
            server.wait(timeout=30)
    text = "\n".join(lines) + "\n"
    print(text)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
