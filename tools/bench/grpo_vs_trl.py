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

`--placement disaggregated` (issue 24) runs Miles alone, once per mode of `--modes`, with the
trainer on one GPU and the engine on another (train.world_size 1, rollout.engines 1: two GPUs),
the weights broadcast over NCCL. one_step_off and async train on older samples, so they get the
`tis` correction (the config check asks for one). Reported per mode, after the warm-up steps: the
median step time and the median `perf/trainer_idle_frac` (the share of the step the trainer was
not training), against the target of under 10% in async. `--tiny` shrinks the model and the step
and runs on CPU (a smoke run of the same settings, not a measurement).

    python tools/bench/grpo_vs_trl.py --steps 10 --placement disaggregated \
        --modes sync,one_step_off,async --out /tmp/w0_disaggregated.md
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
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).parent))
from step_breakdown import breakdown

PROMPT_TOKENS, NEW_TOKENS, PROMPTS, SAMPLES = 64, 256, 8, 8
MODES = ("sync", "one_step_off", "async")
IDLE_TARGET = 0.10  # of the step, in async (issue 24)


class Workload(NamedTuple):
    prompts: int
    samples: int
    prompt_tokens: int
    new_tokens: int
    model: dict[str, Any]  # replaces fields of the stored Qwen3-0.6B config
    device: str  # where the random weights are made
    settings: dict[str, Any]  # run-config sections merged over W0's


W0 = Workload(PROMPTS, SAMPLES, PROMPT_TOKENS, NEW_TOKENS, {}, "cuda", {})
# The same run at a size two CPU cores finish in a few minutes: a check of the settings only.
TINY = Workload(
    prompts=4,
    samples=4,
    prompt_tokens=16,
    new_tokens=16,
    model=dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    device="cpu",
    settings={
        "precision": "fp32",
        "train": {"dtype": "float32", "micro_batch_tokens": 4096},
        "cluster": {"device": "cpu"},
    },
)


def even_share(text: str) -> float:
    words = text.split()
    return sum(int(w[1:]) % 2 == 0 for w in words if w[1:].isdigit()) / max(len(words), 1)


class EvenShare:
    """The Miles reward (`reward.name: grpo_vs_trl:EvenShare`)."""

    async def __call__(self, response: str, sample: Any) -> float:
        return even_share(response)


def write_assets(work: Path, workload: Workload = W0) -> tuple[Path, Path]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from miles.recipes import architectures

    model_dir, data = work / "model", work / "prompts.jsonl"
    config = dict(architectures.config_for("Qwen/Qwen3-0.6B") or {}) | workload.model
    vocab_size = config["vocab_size"]
    if not (model_dir / "config.json").exists():
        model_type = config.pop("model_type")
        config.pop("quantization_config", None)
        config.update(eos_token_id=1, bos_token_id=None, pad_token_id=0)
        torch.manual_seed(0)
        with torch.device(workload.device):
            model = AutoModelForCausalLM.from_config(
                AutoConfig.for_model(model_type, **config),
                dtype=torch.bfloat16 if workload.device == "cuda" else torch.float32,
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
        {
            "prompt": " ".join(
                f"w{rng.randrange(2, vocab_size)}" for _ in range(workload.prompt_tokens)
            )
        }
        for _ in range(workload.prompts * 64)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


def w0_config(
    model_dir: Path,
    data: Path,
    steps: int,
    mode: str = "sync",
    placement: str = "colocated",
    workload: Workload = W0,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "name": "w0",
        "seed": 0,
        "steps": steps,
        "mode": mode,
        "placement": placement,
        "precision": "bf16",
        "model": {"path": str(model_dir)},
        "data": {"path": str(data), "chat_template": False},
        "rollout": {
            "prompts_per_step": workload.prompts,
            "samples_per_prompt": workload.samples,
            "max_new_tokens": workload.new_tokens,
            "temperature": 1.0,
            "max_batch_size": workload.prompts * workload.samples,
        },
        "reward": {"name": "grpo_vs_trl:EvenShare"},
        "algorithm": {"advantage": "grpo", "loss": "ppo_clip"},
        # One micro-batch for the step's ~20K tokens: half the kernel launches of two (the train
        # step is launch-bound at this size); the chunked head keeps it at 60 GB of activations.
        "train": {"lr": 1e-6, "dtype": "bfloat16", "micro_batch_tokens": 32768},
        "checkpoint": {"every": 1000},
    }
    if mode != "sync":
        # Samples from older weights need a train-inference correction (the config check).
        config["algorithm"]["correction"] = "tis"
    for key, value in workload.settings.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def run_miles(
    model_dir: Path,
    data: Path,
    steps: int,
    run_dir: Path,
    extra: list[str],
    mode: str = "sync",
    placement: str = "colocated",
    workload: Workload = W0,
    warmup: int = 2,
) -> dict[str, float]:
    import yaml

    config = run_dir.with_suffix(".yaml")
    config.write_text(yaml.safe_dump(w0_config(model_dir, data, steps, mode, placement, workload)))
    cmd = [sys.executable, "-m", "miles.core.cli", "run", str(config), "--run-dir", str(run_dir)]
    for s in ["telemetry.progress=false", *extra]:
        cmd += ["--set", s]
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parent}:{os.environ.get('PYTHONPATH', '')}",
    }
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    rows = breakdown(run_dir)[warmup:]
    keys = ["total", "rollout", "reward", "train", "sync", "overhead"]
    out = {k: statistics.median(r[k] for r in rows) for k in keys} | {"steps": len(rows)}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(x) for x in lines][warmup:]
    for key in (
        "perf/sync_gbps",
        "perf/sync_verify_s",
        "perf/rollout_s",
        "perf/train_s",
        # The controller's own step clock, and the share of it the trainer was not training.
        "perf/step_s",
        "perf/trainer_idle_frac",
        "perf/rollout_wait_s",
        "perf/sync_s",
        "async/staleness_mean",
    ):
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
    parser.add_argument(
        "--placement",
        choices=["colocated", "disaggregated"],
        default="colocated",
        help="disaggregated: Miles alone (no TRL), trainer and engine on a GPU each",
    )
    parser.add_argument(
        "--modes", default="sync", help=f"comma-separated, of {', '.join(MODES)} (disaggregated)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="leading steps left out")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model and step on CPU: checks the settings"
    )
    args = parser.parse_args()
    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: {bad} are not modes; choose from {', '.join(MODES)}")
    if args.placement == "colocated" and modes != ["sync"]:
        parser.error("--modes: a colocated run needs mode sync; add --placement disaggregated")
    if args.steps <= args.warmup:
        parser.error(f"--steps must exceed --warmup ({args.warmup}) to leave steps to measure")
    workload = TINY if args.tiny else W0
    work = args.work / "tiny" if args.tiny else args.work
    work.mkdir(parents=True, exist_ok=True)
    if args.placement == "disaggregated":
        disaggregated(args, modes, workload, work)
        return
    model_dir, data = write_assets(work, workload)
    run_dir = work / f"miles-{time.time():.0f}"
    miles = run_miles(
        model_dir, data, args.steps, run_dir, args.set, workload=workload, warmup=args.warmup
    )
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
        for name in ("metrics.jsonl", "traces.jsonl", "events.jsonl"):
            shutil.copy(run_dir / name, args.keep / name)
    lines = [
        f"W0, median of steps {args.warmup + 1}-{args.steps} ({args.warmup} warm-up steps left "
        "out)",
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
    if not (args.skip_trl or args.tiny):  # TRL's side is W0 on a GPU only
        trl = run_trl(model_dir, data, args.steps, args.work / "trl")
        lines.append(f"| TRL GRPOTrainer | {trl['total']:.2f} | | | | | |")
        lines += ["", f"Miles step / TRL step: {miles['total'] / trl['total']:.2f}"]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


def disaggregated(
    args: argparse.Namespace, modes: list[str], workload: Workload, work: Path
) -> None:
    """Miles alone in each mode, trainer and engine on GPUs (CPU bundles with --tiny) of their
    own; TRL has no placement to compare with."""
    if not args.tiny:
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < 2:
            sys.exit(
                f"grpo_vs_trl.py --placement disaggregated needs 2 GPUs (trainer and engine on "
                f"one each); found {found}. Use --tiny for a CPU smoke run."
            )
    model_dir, data = write_assets(work, workload)
    lines = [
        f"W0{' (tiny, CPU)' if args.tiny else ''}, placement disaggregated (train.world_size 1, "
        f"rollout.engines 1), median of steps {args.warmup + 1}-{args.steps} (warm-up steps left "
        f"out: {args.warmup}); one_step_off and async with algorithm.correction tis",
        "",
        "| mode | step s | trainer idle | rollout wait s | train s | sync s | sync GB/s "
        "| staleness |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    idle: dict[str, float] = {}
    for mode in modes:
        run_dir = work / f"miles-{mode}-{time.time():.0f}"
        miles = run_miles(
            model_dir,
            data,
            args.steps,
            run_dir,
            args.set,
            mode=mode,
            placement="disaggregated",
            workload=workload,
            warmup=args.warmup,
        )
        if args.keep is not None:
            (args.keep / mode).mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "traces.jsonl", "events.jsonl"):
                shutil.copy(run_dir / name, args.keep / mode / name)
        idle[mode] = miles["perf/trainer_idle_frac"]
        cells = [
            format(miles[key], spec) if key in miles else "-"
            for key, spec in (
                ("perf/step_s", ".3f"),
                ("perf/rollout_wait_s", ".3f"),
                ("perf/train_s", ".3f"),
                ("perf/sync_s", ".3f"),
                ("perf/sync_gbps", ".3g"),
                ("async/staleness_mean", ".2f"),
            )
        ]
        cells.insert(1, f"{100 * idle[mode]:.1f}%")
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
        args.out.write_text("\n".join(lines) + "\n")  # the modes so far survive a failure
    if "async" in idle:
        met = "met" if idle["async"] < IDLE_TARGET else "NOT met"
        lines += [
            "",
            f"Target: trainer idle fraction < {100 * IDLE_TARGET:.0f}% in async: "
            f"{100 * idle['async']:.1f}%, {met}.",
        ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
