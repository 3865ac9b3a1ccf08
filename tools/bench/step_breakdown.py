"""Per-step time of an RL run, split into rollout, reward, train, sync and framework overhead.

    python tools/bench/step_breakdown.py                  # runs `miles run quickstart` first
    python tools/bench/step_breakdown.py --run-dir DIR    # analyses an existing run

Everything comes from the run's own traces.jsonl. Per step (the `miles.step` span, plus the spans
outside any step that carry a step number, such as the rollout manager's `miles.rollout`, counted
in the step whose window they ran in; every part is clipped to the step span):

* rollout:  engine time inside `miles.generate` (model compute, sampling, KV cache)
* reward:   `miles.reward` spans (union over concurrent groups)
* train:    the train rank's `miles.train_step` (logprobs + forward/backward + optimizer)
* sync:     the `miles.weight_sync` span (bucketed broadcast and checksum verification)
* overhead: the rest of the step: scheduling, packing, Ray calls and object transfer

Framework overhead should stay under 10% of step time on CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def _union_seconds(intervals: list[tuple[int, int]]) -> float:
    total, end = 0, -1
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total / 1e9


def breakdown(run_dir: Path) -> list[dict[str, float]]:
    spans = [json.loads(x) for x in (run_dir / "traces.jsonl").read_text().splitlines() if x]
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        children.setdefault(s["parent_span_id"], []).append(s)

    def descendants(span: dict[str, Any]) -> list[dict[str, Any]]:
        out, todo = [], [span]
        while todo:
            for child in children.get(todo.pop()["span_id"], []):
                out.append(child)
                todo.append(child)
        return out

    def under_a_step(span: dict[str, Any]) -> bool:
        parent = by_id.get(span["parent_span_id"])
        while parent is not None:
            if parent["name"] == "miles.step":
                return True
            parent = by_id.get(parent["parent_span_id"])
        return False

    # A step's work is not all inside its `miles.step` span: the rollout manager produces the
    # step's batch under its own span (`miles.rollout`, attribute `step`), a sibling of the step
    # that the controller only waits on. Every span outside a step that names the step number is
    # one more root of that step's work.
    tagged: dict[int, list[dict[str, Any]]] = {}
    for s in spans:
        number = s.get("attributes", {}).get("step")
        if s["name"] != "miles.step" and isinstance(number, int) and not under_a_step(s):
            tagged.setdefault(number, []).append(s)

    # Work outside the steps counts by time, in the step whose window it ran in: the next batch
    # is made in this step's tail (from its weight sync on), so its time is this step's.
    outside = [x for roots in tagged.values() for root in roots for x in (root, *descendants(root))]
    rows = []
    for step in sorted(
        (s for s in spans if s["name"] == "miles.step"), key=lambda s: s["attributes"]["step"]
    ):
        number = step["attributes"]["step"]
        inner = descendants(step) + outside
        lo, hi = step["start_ns"], step["end_ns"]

        def intervals(
            *names: str, inner: list[dict[str, Any]] = inner, lo: int = lo, hi: int = hi
        ) -> list[tuple[int, int]]:
            # Clipped to the step: a rollout that spans two steps' windows counts once, split
            # between them.
            clipped = [
                (max(s["start_ns"], lo), min(s["end_ns"], hi)) for s in inner if s["name"] in names
            ]
            return [(a, b) for a, b in clipped if a < b]

        total = (hi - lo) / 1e9
        stages = {
            "rollout": "miles.generate",
            "reward": "miles.reward",
            "train": "miles.train_step",
            "sync": "miles.weight_sync",
        }
        parts = {k: _union_seconds(intervals(name)) for k, name in stages.items()}
        # Rewards of early groups overlap generation of later ones: count covered time once.
        parts["overhead"] = max(total - _union_seconds(intervals(*stages.values())), 0.0)
        rows.append({"step": number, "total": total, **parts})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, help="analyse this run instead of running one")
    parser.add_argument("--target", default="quickstart", help="recipe or config to run")
    parser.add_argument("--set", action="append", default=[], help="config overrides")
    parser.add_argument("--skip", type=int, default=1, help="leading steps left out (warm-up)")
    args = parser.parse_args()
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="miles-bench-")) / "run"
        cmd = [
            sys.executable,
            "-m",
            "miles.core.cli",
            "run",
            args.target,
            "--run-dir",
            str(run_dir),
            "--set",
            "telemetry.progress=false",
        ]
        for item in args.set:
            cmd += ["--set", item]
        print("$", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
    rows = breakdown(run_dir)[args.skip :]
    if not rows:
        sys.exit("no steps to report")
    keys = ["total", "rollout", "reward", "train", "sync", "overhead"]
    means = {k: statistics.mean(r[k] for r in rows) for k in keys}
    print(f"run: {run_dir}  steps measured: {len(rows)} (first {args.skip} skipped)")
    print("| " + " | ".join(f"{k} s" for k in keys) + " | overhead % |")
    print("|" + "---|" * (len(keys) + 1))
    print(
        "| "
        + " | ".join(f"{means[k]:.3f}" for k in keys)
        + f" | {100 * means['overhead'] / means['total']:.1f} |"
    )


if __name__ == "__main__":
    main()
