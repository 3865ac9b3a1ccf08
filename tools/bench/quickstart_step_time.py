"""The quickstart's mean `perf/step_s`, side by side for several checkouts (or settings) in one
sitting.

    python tools/bench/quickstart_step_time.py --runs 6 . /path/to/other/checkout
    python tools/bench/quickstart_step_time.py --runs 6 . --variant fault.snapshot_every=0
    python tools/bench/quickstart_step_time.py --runs 2 --recipe quickstart-agent . /path/to/other

Each checkout runs `miles run quickstart` with its own `.venv` (made by its `tools/setup.sh`),
once as it is and once per `--variant` (settings for `--set`, comma-separated); runs alternate
between them, so a machine that slows down or speeds up during the sitting weighs on all alike. Per run: the mean of `perf/step_s` over the 30 RL steps, the means
of its parts from steps 2 on, and `eval/reward_mean`; then a summary per checkout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

PARTS = ("perf/rollout_s", "perf/train_s", "perf/sync_s")


def one_run(
    checkout: Path, settings: list[str], run_dir: Path, recipe: str = "quickstart"
) -> dict[str, float]:
    miles = checkout / ".venv/bin/miles"
    sets = [a for s in ["telemetry.progress=false", *settings] for a in ("--set", s)]
    subprocess.run(
        [str(miles), "run", recipe, "--run-dir", str(run_dir), *sets],
        cwd=checkout,
        check=True,
        capture_output=True,
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "perf/step_s" in r]
    out = {"step_s": statistics.mean(r["perf/step_s"] for r in steps)}
    out.update({p: statistics.mean(r[p] for r in steps[2:]) for p in PARTS})
    out["eval"] = [r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r][-1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkouts", nargs="+", type=Path)
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--recipe", default="quickstart", help="a recipe that runs on a CPU")
    parser.add_argument("--variant", action="append", default=[], help="KEY=VALUE[,KEY=VALUE]")
    args = parser.parse_args()
    variants = [[], *(v.split(",") for v in args.variant)]
    results: dict[tuple[Path, str], list[dict[str, float]]] = {
        (c.resolve(), ",".join(v)): [] for c in args.checkouts for v in variants
    }
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for k, ((checkout, variant), runs) in enumerate(results.items()):
                run_dir = Path(tmp) / f"{i}-{k}-{checkout.name}"
                settings = variant.split(",") if variant else []
                run = one_run(checkout, settings, run_dir, args.recipe)
                runs.append(run)
                parts = " ".join(f"{p.split('/')[1]} {run[p]:.4f}" for p in PARTS)
                label = f"{checkout} {variant}".strip()
                print(f"{label}  step_s {run['step_s']:.4f}  {parts}  eval {run['eval']:.4f}")
    for (checkout, variant), runs in results.items():
        steps = [r["step_s"] for r in runs]
        print(
            f"{checkout} {variant or '(as is)'}: {len(runs)} runs, mean perf/step_s "
            f"{statistics.mean(steps):.3f} (min {min(steps):.3f}, max {max(steps):.3f})"
        )


if __name__ == "__main__":
    main()
