"""The quickstart's mean `perf/step_s`, side by side for several checkouts in one sitting.

    python tools/bench/quickstart_step_time.py --runs 6 . /path/to/other/checkout

Each checkout runs `miles run quickstart` with its own `.venv` (made by its `tools/setup.sh`);
runs alternate between checkouts, so a machine that slows down or speeds up during the sitting
weighs on all of them alike. Per run: the mean of `perf/step_s` over the 30 RL steps, the means
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


def one_run(checkout: Path, run_dir: Path) -> dict[str, float]:
    miles = checkout / ".venv/bin/miles"
    subprocess.run(
        [
            *(str(miles), "run", "quickstart", "--run-dir", str(run_dir)),
            "--set",
            "telemetry.progress=false",
        ],
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
    args = parser.parse_args()
    results: dict[Path, list[dict[str, float]]] = {c.resolve(): [] for c in args.checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for checkout in results:
                run = one_run(checkout, Path(tmp) / f"{i}-{len(results[checkout])}-{checkout.name}")
                results[checkout].append(run)
                parts = " ".join(f"{p.split('/')[1]} {run[p]:.4f}" for p in PARTS)
                print(f"{checkout}  step_s {run['step_s']:.4f}  {parts}  eval {run['eval']:.4f}")
    for checkout, runs in results.items():
        steps = [r["step_s"] for r in runs]
        print(
            f"{checkout}: {len(runs)} runs, mean perf/step_s {statistics.mean(steps):.3f} "
            f"(min {min(steps):.3f}, max {max(steps):.3f})"
        )


if __name__ == "__main__":
    main()
