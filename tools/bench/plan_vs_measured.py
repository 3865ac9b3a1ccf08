"""The memory planner against what a GPU really holds.

For a stored real architecture (optionally with fewer layers so it fits one GPU), this builds the
model with random weights at full width, then measures on one GPU:
- train: the FSDP trainer's peak memory over one train step of `--micro-batch-tokens` tokens
  (weights, gradients, AdamW state and activations);
- rollout: the native engine's peak memory while it decodes `--concurrency` sequences of
  `--prompt-tokens` + `--new-tokens` (weights and KV cache),
and prints both next to `miles recipes plan`'s numbers for the same config.

    python tools/bench/plan_vs_measured.py --checkpoint Qwen/Qwen3-0.6B --out plan.json
    python tools/bench/plan_vs_measured.py --checkpoint Qwen/Qwen3-30B-A3B --layers 4

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

GB = 1e9


def write_checkpoint(checkpoint: str, layers: int | None, out: Path) -> dict[str, Any]:
    """The stored config of `checkpoint` (maybe cut to `layers`), random weights, saved."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.recipes import architectures
    from miles.recipes.words import build_tokenizer

    config = architectures.config_for(checkpoint)
    if config is None:
        raise SystemExit(f"no stored architecture for {checkpoint}")
    text = config.get("text_config", config)
    fields = dict(text)
    fields.pop("quantization_config", None)
    if layers is not None:
        fields["num_hidden_layers"] = layers
        for key in ("layer_types", "mlp_layer_types"):
            if isinstance(fields.get(key), list):
                fields[key] = fields[key][:layers]
    model_type = fields.pop("model_type")
    hf_config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    del model
    torch.cuda.empty_cache()
    return {"model_type": model_type, **fields}


def measure_train(path: str, tokens: int, seq_len: int) -> float:
    from miles.core.contracts.types import PackedBatch, Sample
    from miles.torch.testing import make_trainer

    trainer = make_trainer(
        path,
        master_port=29533,
        device="cuda",
        lr=1e-6,
        micro_batch_tokens=tokens,
        dtype="bfloat16",
        activation_checkpointing=True,
    )
    rng = np.random.default_rng(0)
    n = tokens // seq_len
    samples = [
        Sample(
            prompt_ids=rng.integers(10, 1000, seq_len // 2).tolist(),
            response_ids=rng.integers(10, 1000, seq_len - seq_len // 2).tolist(),
            sample_id=i,
        )
        for i in range(n)
    ]
    batch = PackedBatch.from_samples(samples, advantages=[1.0 if i % 2 else -1.0 for i in range(n)])

    def loss(inputs: Any) -> Any:
        return -inputs.advantages * inputs.logprobs, {}

    trainer.train_step(batch, loss)  # the first step allocates AdamW's state
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(batch, loss)
    peak = torch.cuda.max_memory_allocated() / GB
    trainer.close()
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def measure_rollout(path: str, concurrency: int, prompt: int, new: int) -> tuple[float, float]:
    from miles.core.contracts.types import GenerateRequest, SamplingParams
    from miles.torch.engine.engine import TorchRolloutEngine

    engine = TorchRolloutEngine(
        path, device="cuda", dtype="bfloat16", max_batch_size=concurrency, seed=0
    )
    weights = torch.cuda.memory_allocated() / GB
    rng = np.random.default_rng(1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
    requests = [
        GenerateRequest(i, rng.integers(10, 1000, prompt).tolist(), sampling)
        for i in range(concurrency)
    ]
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    tokens = sum(len(r.response_ids) for r in engine.results(requests))
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / GB
    print(f"rollout: {tokens} tokens in {seconds:.1f} s")
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return weights, peak


def planned(path: str, tokens: int, concurrency: int, prompt: int, new: int) -> dict[str, Any]:
    from miles.core.config import parse
    from miles.runtime.planning.planner import plan

    run = parse(
        {
            "model": {"path": path},
            "data": {"path": "x.jsonl"},
            "precision": "bf16",
            "train": {
                "micro_batch_tokens": tokens,
                "activation_checkpointing": True,
                "dtype": "bfloat16",
            },
            "rollout": {
                "prompts_per_step": concurrency,
                "samples_per_prompt": 1,
                "max_new_tokens": new,
                "max_batch_size": concurrency,
            },
            "planner": {"prompt_tokens": prompt},
        }
    )
    return plan(run).to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--layers", type=int, default=None, help="keep only this many layers")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(args.checkpoint, args.layers, Path(tmp))
        plan = planned(
            tmp, args.micro_batch_tokens, args.concurrency, args.prompt_tokens, args.new_tokens
        )
        train_peak = measure_train(tmp, args.micro_batch_tokens, args.seq_len)
        weights, rollout_peak = measure_rollout(
            tmp, args.concurrency, args.prompt_tokens, args.new_tokens
        )
    result = {
        "checkpoint": args.checkpoint,
        "layers": args.layers,
        "params": plan["params"]["language_model"],
        "train": {"planned_gb": sum(plan["train_gb"].values()), "measured_peak_gb": train_peak},
        "train_planned_gb": plan["train_gb"],
        "rollout": {
            "planned_gb": sum(plan["rollout_gb"].values()),
            "measured_peak_gb": rollout_peak,
            "planned_weights_gb": plan["rollout_gb"]["weights"],
            "measured_weights_gb": weights,
            "planned_kv_gb": plan["rollout_gb"]["kv_cache"],
            "measured_above_weights_gb": rollout_peak - weights,
        },
        "settings": vars(args),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
