"""Kill a run after its first checkpoint, resume it, and compare it with the same run whole.

Runs `miles run RECIPE --set ...` twice: once whole, once killed (SIGKILL to its process group)
as soon as a complete checkpoint exists, then `miles run --resume` on the killed run's
directory. Compares every metric of every step that is not a time, a rate or a count of
seconds between the two (the resumed run's rows after the checkpoint replace the killed run's),
and writes a Markdown summary:

    python tools/bench/kill_resume.py quickstart --set checkpoint.every=10 \\
        --set train.backend=megatron --set placement=colocated --out /tmp/kill_resume.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from miles.runtime.rundir import latest_valid_checkpoint

# Metrics that measure the machine rather than the run: they differ between any two runs.
_TIMING_MARKERS = ("_s", "per_s", "_frac_time", "tflops", "mfu", "gb_per_s", "perf/", "memory")


def _is_timing(key: str) -> bool:
    return any(m in key for m in _TIMING_MARKERS)


def _miles(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "miles.core.cli", *args]


def _rows(run_dir: Path) -> dict[int, dict[str, Any]]:
    """The last row of each step in metrics.jsonl (a resumed run rewrites the steps it redoes)."""
    rows: dict[int, dict[str, Any]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            rows.setdefault(int(row["step"]), {}).update(row)
    return rows


def _killed_after_checkpoint(cmd: list[str], run_dir: Path, log: Path, timeout: float) -> int:
    """Starts `cmd`, SIGKILLs its process group once `run_dir` holds a complete checkpoint;
    the step of that checkpoint."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = latest_valid_checkpoint(run_dir) if run_dir.exists() else None
        if found is not None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return found[0]
        if proc.poll() is not None:
            raise SystemExit(f"the run ended (rc {proc.returncode}) before a checkpoint: {log}")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(f"no checkpoint within {timeout:.0f} s: {log}")


def _run(cmd: list[str], log: Path) -> None:
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (rc {rc}): see {log}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", action="append", default=[], help="Miles settings, as miles run")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kill-resume"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/kill_resume.md"))
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to a checkpoint")
    args = parser.parse_args()
    sets = [a for s in args.set for a in ("--set", s)]
    whole, killed = args.work / "whole", args.work / "killed"
    args.work.mkdir(parents=True, exist_ok=True)

    _run(_miles(["run", args.recipe, "--run-dir", str(whole), *sets]), args.work / "whole.log")
    cmd = _miles(["run", args.recipe, "--run-dir", str(killed), *sets])
    step = _killed_after_checkpoint(cmd, killed, args.work / "killed.log", args.timeout)
    _run(_miles(["run", "--resume", "--run-dir", str(killed)]), args.work / "resumed.log")

    a, b = _rows(whole), _rows(killed)
    compared, equal, worst = 0, 0, (0.0, "", -1)
    for s in sorted(set(a) | set(b)):
        if s not in a or s not in b:
            raise SystemExit(f"step {s} is in one run only")
        for key, value in a[s].items():
            if key == "step" or _is_timing(key) or not isinstance(value, (int, float)):
                continue
            other = b[s].get(key)
            if not isinstance(other, (int, float)):
                continue
            compared += 1
            diff = abs(float(value) - float(other))
            equal += diff == 0 or (math.isnan(value) and math.isnan(other))
            if diff > worst[0]:
                worst = (diff, key, s)
    lines = [
        f"# `{args.recipe}` killed after its step-{step} checkpoint and resumed, against it whole",
        "",
        f"settings: `{' '.join(args.set) or '(none)'}`",
        "",
        f"- steps: {len(a)} in both",
        f"- metric values compared (times and rates left out): {compared}",
        f"- equal: {equal}",
        f"- largest difference: {worst[0]:.3g} ({worst[1]} at step {worst[2]})",
    ]
    for key in sorted(k for k in a[max(a)] if k.startswith("eval/") and not _is_timing(k)):
        lines.append(
            f"- last step's `{key}`: {a[max(a)][key]:.4g} whole, {b[max(b)][key]:.4g} resumed"
        )
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
