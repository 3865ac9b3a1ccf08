"""Benchmark W0: one GRPO step of Miles (`miles run`, embedded default, colocated on one GPU)
against TRL's `GRPOTrainer` (HF `generate`), same model and same work per step, in one process
tree on one machine.

W0: a random-weight Qwen3-0.6B shape (the stored architecture) with a word-level tokenizer over
the whole vocabulary ("w0" ... "w151935", so random weights almost never sample eos and every
completion runs to its limit), no chat template, 8 prompts x 8 samples, 64-token prompts, 256
new tokens at temperature 1, bf16, lr 1e-6, no KL. The reward (the share of even word ids in the
completion) is the same function on both sides. Reported: the median step after 2 warm-up
steps, and Miles' breakdown from its traces (rollout, reward, train, sync, other).

    python tools/bench/grpo_vs_trl.py --steps 7 --out /tmp/grpo_vs_trl.md [--skip-trl]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from step_breakdown import breakdown

PROMPT_TOKENS, NEW_TOKENS, PROMPTS, SAMPLES = 64, 256, 8, 8


def even_share(text: str) -> float:
    words = text.split()
    return sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(len(words), 1)


class EvenShare:
    """The Miles reward (`reward.name: grpo_vs_trl:EvenShare`)."""

    async def __call__(self, response: str, sample: Any) -> float:
        return even_share(response)


def write_assets(work: Path) -> tuple[Path, Path]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from miles.recipes import architectures

    model_dir, data = work / "model", work / "prompts.jsonl"
    config = dict(architectures.config_for("Qwen/Qwen3-0.6B") or {})
    vocab_size = config["vocab_size"]
    if not (model_dir / "config.json").exists():
        model_type = config.pop("model_type")
        config.pop("quantization_config", None)
        config.update(eos_token_id=1, bos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, **config), dtype=torch.bfloat16
            )
        model.save_pretrained(str(model_dir))
        del model
        vocab = {f"w{i}": i for i in range(vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="w0", eos_token="w1", unk_token="w0"
        ).save_pretrained(str(model_dir))
    rng = random.Random(0)
    rows = [
        {"prompt": " ".join(f"w{rng.randrange(2, vocab_size)}" for _ in range(PROMPT_TOKENS))}
        for _ in range(PROMPTS * 64)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def w0_config(model_dir: Path, data: Path, steps: int) -> dict[str, Any]:
    return {
        "name": "w0",
        "seed": 0,
        "steps": steps,
        "mode": "sync",
        "placement": "colocated",
        "precision": "bf16",
        "model": {"path": str(model_dir)},
        "data": {"path": str(data), "chat_template": False},
        "rollout": {
            "prompts_per_step": PROMPTS,
            "samples_per_prompt": SAMPLES,
            "max_new_tokens": NEW_TOKENS,
            "temperature": 1.0,
            "max_batch_size": PROMPTS * SAMPLES,
        },
        "reward": {"name": "grpo_vs_trl:EvenShare"},
        "algorithm": {"advantage": "grpo", "loss": "ppo_clip"},
        # One micro-batch for the step's ~20K tokens: half the kernel launches of two (the train
        # step is launch-bound at this size); the chunked head keeps it at 60 GB of activations.
        "train": {"lr": 1e-6, "dtype": "bfloat16", "micro_batch_tokens": 32768},
        "checkpoint": {"every": 1000},
    }


def run_miles(model_dir: Path, data: Path, steps: int, run_dir: Path, extra: list[str]) -> dict:
    import yaml

    config = run_dir.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(w0_config(model_dir, data, steps)))
    cmd = [sys.executable, "-m", "miles.core.cli", "run", str(config), "--run-dir", str(run_dir)]
    for s in ["telemetry.progress=false", *extra]:
        cmd += ["--set", s]
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}",
    }
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    rows = breakdown(run_dir)[2:]
    keys = ["total", "rollout", "reward", "train", "sync", "overhead"]
    out = {k: statistics.median(r[k] for r in rows) for k in keys} | {"steps": len(rows)}
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    for key in ("perf/sync_gbps", "perf/sync_verify_s", "perf/rollout_s", "perf/train_s"):
        values = [m[key] for m in metrics if key in m]
        if values:
            out[key] = statistics.median(values)
    return out


def run_trl(model_dir: Path, data: Path, steps: int, out: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(x) for x in data.read_text().splitlines()]

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [even_share(c) for c in completions]

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._start)

    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=SAMPLES,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=1e-6,
        beta=0.0,
        bf16=True,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=0,
        model_init_kwargs={"dtype": torch.bfloat16},
    )
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        callbacks=[timer],
    )
    trainer.train()
    return {"total": statistics.median(timer.times[2:]), "steps": len(timer.times) - 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--work", type=Path, default=Path("/tmp/grpo-vs-trl"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/grpo_vs_trl.md"))
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="extra Miles settings")
    parser.add_argument("--keep", type=Path, default=None, help="copy the Miles run's files here")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir, data = write_assets(args.work)
    run_dir = args.work / f"miles-{time.time():.0f}"
    miles = run_miles(model_dir, data, args.steps, run_dir, args.set)
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "traces.jsonl", "events.jsonl"):
            shutil.copy(run_dir / name, args.keep / name)
    lines = [
        f"W0, median of steps 3-{args.steps} (2 warm-up steps left out)",
        "",
        "| | step s | rollout s | reward s | train s | sync s | other s |",
        "|---|---|---|---|---|---|---|",
        "| Miles | "
        + " | ".join(
            f"{miles[k]:.2f}" for k in ["total", "rollout", "reward", "train", "sync", "overhead"]
        )
        + " |",
        "",
        "Miles per step (medians): "
        + ", ".join(
            f"{k} {miles[k]:.3g}"
            for k in ("perf/rollout_s", "perf/train_s", "perf/sync_gbps", "perf/sync_verify_s")
            if k in miles
        ),
    ]
    args.out.write_text("\n".join(lines) + "\n")  # Miles' half survives a TRL failure
    if not args.skip_trl:
        trl = run_trl(model_dir, data, args.steps, args.work / "trl")
        lines.append(f"| TRL GRPOTrainer | {trl['total']:.2f} | | | | | |")
        lines += ["", f"Miles step / TRL step: {miles['total'] / trl['total']:.2f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
