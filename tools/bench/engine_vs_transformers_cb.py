"""Benchmark: miles' TorchRolloutEngine vs transformers' continuous batching (`generate_batch`).

Same random-weight model, same prompts, greedy and sampled decoding. Reports tokens/s and whether
each side's per-token logprobs equal log_softmax(logits / T) of a plain no-cache forward over the
*unfiltered* vocabulary (what RL importance ratios need). Writes a markdown report.

    PYTHONPATH=packages/miles-core/src:packages/miles-torch/src \\
        python tools/bench/engine_vs_transformers_cb.py --out /tmp/engine_bench.md
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import tempfile
import time
import traceback

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.testing import make_tiny_model

MODELS = {
    # The unit-test model: 2 layers, hidden 64, vocab 128. Dominated by per-step overhead.
    "tiny": dict(vocab_size=128),
    # Wider and deeper, so matmuls and attention matter more than Python overhead.
    "small": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
    ),
}


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(8, 64, (n,), generator=g)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in lens]


def best_time(fn, repeats: int):
    """(best wall seconds, last result) over `repeats` calls; the first call also warms up."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def max_logprob_error(model, prompts, responses, logprobs, temperature: float) -> float:
    """Max |reported - log_softmax(logits / T)[token]| against an unpadded, uncached forward."""
    worst = 0.0
    with torch.inference_mode():
        for prompt, resp, lps in zip(prompts, responses, logprobs, strict=True):
            if not resp:
                continue
            ids = torch.tensor([prompt + resp], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float().cpu()
            ref = torch.log_softmax(logits / temperature, dim=-1)
            ref = ref.gather(1, torch.tensor(resp).unsqueeze(1)).squeeze(1)
            worst = max(worst, (ref - torch.tensor(lps)).abs().max().item())
    return worst


def run_engine(path, prompts, sampling: SamplingParams, max_batch_size: int, repeats: int, device):
    engine = TorchRolloutEngine(path, device=device, max_batch_size=max_batch_size)
    reqs = [GenerateRequest(i, p, sampling) for i, p in enumerate(prompts)]
    seconds, results = best_time(
        lambda: sorted(engine.results(reqs), key=lambda r: r.request_id), repeats
    )
    return seconds, [r.response_ids for r in results], [r.logprobs for r in results]


def cb_config(prompts, new_tokens: int, sized: bool) -> ContinuousBatchingConfig:
    """Default CB config (cache auto-sized from memory), or a paged cache sized to the workload.

    On CPU the default sizing allocates a cache for most of host memory, which dominates the run.
    """
    if not sized:
        return ContinuousBatchingConfig(return_logprobs=True, seed=0)
    page = 64
    blocks = sum(-(-(len(p) + new_tokens) // page) for p in prompts)
    return ContinuousBatchingConfig(
        return_logprobs=True, seed=0, page_size=page, num_blocks=blocks, max_batch_tokens=4096
    )


def run_cb(model, prompts, sampling: SamplingParams, repeats: int, style: str):
    """transformers CB. style: "default" / "sized" (generate_batch) or "persistent" (a started
    manager reused across calls, so setup and teardown are not timed)."""
    greedy = sampling.temperature == 0
    gen = GenerationConfig(
        max_new_tokens=sampling.max_new_tokens,
        do_sample=not greedy,
        temperature=None if greedy else sampling.temperature,
        top_p=None if greedy or sampling.top_p >= 1 else sampling.top_p,
        top_k=None if greedy or sampling.top_k < 0 else sampling.top_k,
        eos_token_id=-1,  # never stop early: same work as the engine run
        pad_token_id=0,
    )
    cb = cb_config(prompts, sampling.max_new_tokens, sized=style != "default")
    order = {}

    def collect(outputs) -> tuple[list[list[int]], list[list[float]]]:
        outs = sorted(outputs, key=lambda o: order[o.request_id])
        return [list(o.generated_tokens) for o in outs], [list(o.logprobs) for o in outs]

    if style != "persistent":

        def call():
            out = model.generate_batch(
                prompts, generation_config=gen, continuous_batching_config=cb
            )
            order.update({k: int(k.split("_")[-1]) for k in out})
            return collect(out.values())

        seconds, (tokens, logprobs) = best_time(call, repeats)
        return seconds, tokens, logprobs

    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb
    ) as manager:

        def call():
            ids = manager.add_requests(inputs=prompts, max_new_tokens=sampling.max_new_tokens)
            order.update({rid: i for i, rid in enumerate(ids)})
            done = []
            while len(done) < len(ids):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise TimeoutError("continuous batching produced no result in 60 s")
                if result.is_finished():
                    done.append(result)
            return collect(done)

        seconds, (tokens, logprobs) = best_time(call, repeats)
    return seconds, tokens, logprobs


def bench_model(name: str, args, lines: list[str]) -> None:
    path = make_tiny_model(tempfile.mkdtemp(prefix=f"bench_{name}_"), "qwen3", **MODELS[name])
    model = AutoModelForCausalLM.from_pretrained(path).to(args.device).eval()
    prompts = make_prompts(args.prompts, MODELS[name]["vocab_size"])
    modes = {
        "greedy": SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens),
        "T=0.7": SamplingParams(temperature=0.7, max_new_tokens=args.new_tokens),
        "T=0.7, top_p=0.9, top_k=20": SamplingParams(
            temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=args.new_tokens
        ),
    }
    n_params = sum(p.numel() for p in model.parameters())
    lines += [f"### Model `{name}` ({n_params / 1e6:.2f} M params, fp32)", ""]
    lines += ["| decoding | implementation | tokens/s | max logprob error | exact logprobs |"]
    lines += ["|---|---|---:|---:|---|"]
    for mode, sampling in modes.items():
        temp = sampling.temperature or 1.0
        runs = {
            "miles TorchRolloutEngine": lambda s=sampling: run_engine(
                path, prompts, s, args.prompts, args.repeats, args.device
            ),
            "CB `generate_batch`, sized cache": lambda s=sampling: run_cb(
                model, prompts, s, args.repeats, "sized"
            ),
            "CB persistent manager, sized cache": lambda s=sampling: run_cb(
                model, prompts, s, args.repeats, "persistent"
            ),
        }
        if mode == "greedy":  # the default sizing is slow on CPU; once is enough to show it
            runs["CB `generate_batch`, default config"] = lambda s=sampling: run_cb(
                model, prompts, s, args.repeats, "default"
            )
        for impl, fn in runs.items():
            try:
                seconds, responses, logprobs = fn()
            except Exception as exc:  # record why, rather than abort the whole report
                traceback.print_exc()
                lines.append(f"| {mode} | {impl} | failed | | `{type(exc).__name__}: {exc}` |")
                continue
            tokens = sum(len(r) for r in responses)
            err = max_logprob_error(model, prompts, responses, logprobs, temp)
            exact = "yes" if err < 1e-4 else "**no**"
            lines.append(f"| {mode} | {impl} | {tokens / seconds:,.0f} | {err:.1e} | {exact} |")
            print(lines[-1], flush=True)
    lines.append("")


def bench_ragged(args, lines: list[str]) -> None:
    """Ragged lengths: refilling freed slots vs fixed batches, dropping vs keeping finished rows."""
    path = make_tiny_model(tempfile.mkdtemp(prefix="bench_ragged_"), "qwen3", **MODELS["small"])
    n, size = 4 * args.prompts, args.prompts
    prompts = make_prompts(n, MODELS["small"]["vocab_size"], seed=1)
    g = torch.Generator().manual_seed(2)
    budgets = torch.randint(4, 2 * args.new_tokens, (n,), generator=g).tolist()
    engine = TorchRolloutEngine(path, device=args.device, max_batch_size=size)

    def run(ids: range, pad_to_longest: bool = False) -> int:
        """Generate; return the tokens each request would have got with its own budget."""
        longest = max(budgets[i] for i in ids)
        reqs = [
            GenerateRequest(
                i,
                prompts[i],
                SamplingParams(
                    temperature=0, max_new_tokens=longest if pad_to_longest else budgets[i]
                ),
            )
            for i in ids
        ]
        return sum(min(len(r.response_ids), budgets[r.request_id]) for r in engine.results(reqs))

    def waves(pad_to_longest: bool = False) -> int:
        return sum(run(range(s, s + size), pad_to_longest) for s in range(0, n, size))

    cases = {
        "continuous: finished rows dropped, freed slots refilled (the engine)": lambda: run(
            range(n)
        ),
        "static batches of max_batch_size, finished rows dropped": waves,
        # Same forward shapes as keeping finished rows in the batch, masked, until the
        # batch's longest request ends (rows stopping early on eos still leave: ~5% of them).
        "static batches, finished rows kept until the longest ends (emulated)": lambda: waves(True),
    }
    lines += [
        f"### Ragged lengths: {n} prompts, max_new_tokens uniform in [4, {2 * args.new_tokens}), "
        f"max_batch_size {size}, model `small`, greedy",
        "",
        "| strategy | useful tokens/s |",
        "|---|---:|",
    ]
    for name, fn in cases.items():
        seconds, useful = best_time(fn, args.repeats)
        lines.append(f"| {name} | {useful / seconds:,.0f} |")
        print(lines[-1], flush=True)
    lines.append("")


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU {platform.processor() or platform.machine()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="/tmp/engine_bench.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    import transformers

    lines = [
        "## Native engine vs transformers continuous batching",
        "",
        f"{args.prompts} prompts of 8-63 tokens, up to {args.new_tokens} new tokens each (CB runs "
        "with eos disabled; the engine stops the few rows that sample eos: tokens/s counts the "
        f"tokens actually made). Random-weight Qwen3, {device_name(args.device)}, "
        f"{args.threads} CPU thread(s), torch {torch.__version__}, transformers "
        f"{transformers.__version__}. Best of {args.repeats} runs, model already loaded. "
        "'max logprob error' is against log_softmax(logits / T) of a plain no-cache forward over "
        "the unfiltered vocabulary.",
        "",
    ]
    for name in MODELS:
        bench_model(name, args, lines)
    bench_ragged(args, lines)
    with open(args.out, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
