"""A hub recipe run as it is, minus the download: the recipe's real architecture with random
weights (`--checkpoint`'s stored config.json) and a local dataset in the recipe's row format.

    python tools/bench/recipe_smoke.py qwen3-0.6b-gsm8k-grpo --steps 3 --run-dir /tmp/smoke

Everything else (layout, precision, lengths, concurrency, algorithm, reward) is the recipe's;
`miles run` then checks the memory plan and runs on this machine's GPUs.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from plan_vs_measured import write_checkpoint


def gsm8k_rows(n: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        rows.append(
            {
                "question": f"Tom has {a} apples and buys {b} more. How many now?",
                "answer": f"{a} + {b} = {a + b}\n#### {a + b}",
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--checkpoint", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--run-dir", default="/tmp/recipe-smoke")
    args = parser.parse_args()
    work = Path(args.run_dir + "-assets")
    model = work / "model"
    if not (model / "config.json").exists():
        model.mkdir(parents=True, exist_ok=True)
        write_checkpoint(args.checkpoint, None, model)
    data = work / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows(512, 0)))
    cmd = [
        sys.executable,
        "-m",
        "miles.core.cli",
        "run",
        args.recipe,
        "--run-dir",
        args.run_dir,
        "--set",
        f"model.path={model}",
        "--set",
        f"data.path={data}",
        "--set",
        f"eval.data={data}",
        "--set",
        "eval.max_prompts=32",
        "--set",
        f"steps={args.steps}",
        "--set",
        "telemetry.progress=false",
    ]
    raise SystemExit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
