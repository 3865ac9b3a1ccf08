"""Benchmark: the `megatron` backend's memory model against the measured peak on one GPU.

A random-weight checkpoint of a stored config (default Qwen/Qwen3-0.6B's shape) is trained by
`MegatronTrainer` on one GPU (bf16 weights, fp32 main weights, Adam): logprobs, then two train
steps on a batch of one full micro-batch, with and without activation checkpointing. Reported per
setting: `torch.cuda.max_memory_allocated` over the steps, the planner's estimate for the same
layout (`miles.megatron.memory.megatron_memory`, the sum of its rows) and their ratio.

    python tools/bench/megatron_memory.py --out /tmp/megatron_memory.md
    python tools/bench/megatron_memory.py --model qwen3@Qwen/Qwen3-1.7B --tokens 8192,16384
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import PackedBatch, Sample


def _checkpoint(model: str, out: Path) -> tuple[str, dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from miles.core.registry.families import family_named
    from miles.torch.testing import make_tokenizer

    name, _, hub_id = model.partition("@")
    family = family_named(name)
    assert family.config_for is not None
    config = family.config_for(hub_id)
    assert config is not None, f"no stored config.json for {hub_id}"
    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(config["model_type"], **fields), dtype=torch.bfloat16
        )
    hf.save_pretrained(out)
    make_tokenizer(256).save_pretrained(out)
    del hf
    torch.cuda.empty_cache()
    return str(out), config


def _loss(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    return -ratio * inputs.advantages, {}


def _batch(vocab: int, tokens: int, seqs: int) -> PackedBatch:
    rng = np.random.default_rng(0)
    each = tokens // seqs
    samples = [
        Sample(
            prompt_ids=rng.integers(0, vocab, 64).tolist(),
            response_ids=rng.integers(0, vocab, each - 64).tolist(),
            sample_id=i,
        )
        for i in range(seqs)
    ]
    return PackedBatch.from_samples(samples, advantages=rng.standard_normal(seqs).tolist())


def _plan(config: dict, tokens: int, checkpointing: bool) -> float:
    from miles.core.contracts.memory import Layout, TrainInputs
    from miles.core.registry.families import family_of_config
    from miles.megatron.config import MegatronConfig
    from miles.megatron.memory import megatron_memory

    family = family_of_config(config)
    assert family is not None and family.shape is not None
    layout = Layout(
        train_gpus=1, tensor=1, pipeline=1, expert=1, context=1, engines=1,
        gpus_per_engine=1, colocated=True,
    )  # fmt: skip
    inputs = TrainInputs(
        shape=family.shape(config), layout=layout, compute_bytes=2, lora=False, reference=False
    )
    cfg = MegatronConfig(micro_batch_tokens=tokens, activation_checkpointing=checkpointing)
    return float(sum(megatron_memory(inputs, cfg).rows.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3@Qwen/Qwen3-0.6B")
    parser.add_argument("--tokens", default="8192,16384", help="micro-batch tokens to try")
    parser.add_argument("--out", default="/tmp/megatron_memory.md")
    args = parser.parse_args()
    from miles.megatron.testing import make_trainer
    from miles.runtime.cluster.process import free_port

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path, config = _checkpoint(args.model, Path(tmp) / "model")
        vocab = int(config["vocab_size"])
        for tokens in (int(t) for t in args.tokens.split(",")):
            for checkpointing in (False, True):
                trainer = make_trainer(
                    path,
                    master_port=free_port(),
                    device="cuda",
                    micro_batch_tokens=tokens,
                    activation_checkpointing=checkpointing,
                    lr=1e-6,
                )
                batch = _batch(vocab, tokens, 8)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                batch.old_logprobs = trainer.logprobs(batch).logprobs
                for _ in range(2):
                    trainer.train_step(batch, _loss)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
                plan = _plan(config, tokens, checkpointing)
                row = {
                    "micro_batch_tokens": tokens,
                    "activation_checkpointing": checkpointing,
                    "measured_gb": peak / 1e9,
                    "planned_gb": plan / 1e9,
                    "plan_over_measured": plan / peak,
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                trainer.close()
                del trainer
                torch.cuda.empty_cache()
    lines = [
        f"{args.model} (random weights) on {torch.cuda.get_device_name()}, one GPU, bf16 weights, "
        "fp32 main weights and Adam; logprobs then two train steps on one full micro-batch",
        "",
        "| micro-batch tokens | activation checkpointing | measured peak GB | planned GB "
        "| plan / measured |",
        "|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['micro_batch_tokens']} | {r['activation_checkpointing']} | "
            f"{r['measured_gb']:.2f} | {r['planned_gb']:.2f} | {r['plan_over_measured']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
