"""Mutation testing of the modules where a silent bug costs most (not part of CI).

    .venv/bin/python tools/mutation.py                 # every target, one after another
    .venv/bin/python tools/mutation.py losses ledger   # some of them
    .venv/bin/python tools/mutation.py --list          # the targets, their files and tests

Each target runs mutmut (https://github.com/boxed/mutmut, installed here with pip when missing) in
a workspace of its own under `.mutation/<target>/` (git-ignored via `.mutation/.gitignore`): a copy
of the owning packages' `src` trees and of the target's unit tests, so mutants never touch the
working tree that other work shares. mutmut mutates only the target's files, and each mutant runs
only the tests that reach the mutated function, in a process forked from one that already imported
torch: a target takes minutes on 2 cores. The kill rates and the surviving mutants go to
`.mutation/<target>/report.txt` and the terminal; docs/testing.md records them and explains
every survivor that no test can kill.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutation"


@dataclass(frozen=True)
class Target:
    packages: tuple[str, ...]  # distributions whose `src` trees the workspace copies
    mutate: tuple[str, ...]  # globs under src/ of the files to mutate
    tests: tuple[str, ...]  # repo-relative test files (globs) the mutants run against
    summary: str


TARGETS = {
    "losses": Target(
        ("miles-losses",),
        ("miles/losses/*.py",),
        ("packages/miles-losses/tests/test_*.py",),
        "advantage estimators, policy losses, KL, mismatch corrections",
    ),
    "sampler": Target(
        ("miles-torch",),
        ("miles/torch/engine/sampler.py", "miles/torch/train/logprobs.py"),
        (
            "packages/miles-torch/tests/test_engine_sampling.py",
            "packages/miles-torch/tests/test_sampler_mutants.py",
            "packages/miles-torch/tests/test_token_logprobs.py",
        ),
        "the engine's token sampler and the trainer's logprob path",
    ),
    "sync": Target(
        ("miles-core", "miles-torch"),
        ("miles/core/contracts/weight_sync.py", "miles/torch/sync/checksum.py"),
        (
            "packages/miles-torch/tests/test_sync_ipc.py",
            "packages/miles-torch/tests/test_sync_plan_checksum.py",
        ),
        "weight-sync bucket planning and tensor checksums",
    ),
    "ledger": Target(
        ("miles-core", "miles-runtime"),
        ("miles/runtime/rollout/ledger.py", "miles/runtime/rollout/buffer.py"),
        (
            "packages/miles-runtime/tests/test_buffer.py",
            "packages/miles-runtime/tests/test_batch_buffer.py",
            "packages/miles-runtime/tests/test_ledger.py",
        ),
        "the sample ledger and the rollout buffer policies",
    ),
    "weight_updates": Target(
        ("miles-core", "miles-runtime"),
        ("miles/runtime/loop/weight_updates.py",),
        ("packages/miles-runtime/tests/test_weight_updates.py",),
        "the weight updater: sync order, redone syncs, checksum verification",
    ),
}

# What the suite's own pytest set-up gives these tests (the root conftest.py and pytest options).
PYPROJECT = """\
[tool.mutmut]
source_paths = ["src"]
only_mutate = {only}
pytest_add_cli_args = ["-p", "no:cacheprovider", "--import-mode=importlib", "-q", "-p", "no:randomly"]
pytest_add_cli_args_test_selection = {tests}
also_copy = ["conftest.py"]
# torch is not fork-safe once used: fork each mutant from a clean server process.
process_isolation = "forkserver"
timeout_multiplier = 5.0
timeout_constant = 10.0
use_git_change_detection = false

[tool.pytest.ini_options]
markers = ["gpu: needs a CUDA GPU", "slow: an end-to-end run over a minute"]
filterwarnings = ["ignore::DeprecationWarning"]
"""

STATUS = {1: "killed", 3: "killed", 0: "survived", 36: "timeout", 24: "timeout", -24: "timeout"}
STATUS |= {152: "timeout", 255: "timeout", 33: "no tests", 5: "no tests", 34: "skipped"}


def ensure_mutmut() -> None:
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print("== installing mutmut (pip)")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "mutmut"], check=True)


def prepare(name: str, target: Target) -> Path:
    """A fresh workspace: src/ (the packages' trees merged; `miles` is a namespace), tests/."""
    ws = WORK / name
    shutil.rmtree(ws, ignore_errors=True)
    (ws / "tests").mkdir(parents=True)
    WORK.joinpath(".gitignore").write_text("*\n")
    for package in target.packages:
        shutil.copytree(
            ROOT / "packages" / package / "src",
            ws / "src",
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    tests = sorted({Path(p) for pattern in target.tests for p in glob.glob(str(ROOT / pattern))})
    missing = [t for t in target.tests if not glob.glob(str(ROOT / t))]
    if missing:
        raise SystemExit(f"{name}: no test file matches {missing}")
    for test in tests:
        shutil.copy(test, ws / "tests" / test.name)
        for helper in ("conftest.py", "fakes.py", "__init__.py"):  # the package's test helpers
            if (test.parent / helper).exists():
                shutil.copy(test.parent / helper, ws / "tests" / helper)
    shutil.copy(ROOT / "conftest.py", ws / "conftest.py")  # GPU tests skip without CUDA
    only = [f"src/{glob_}" for glob_ in target.mutate]
    selection = [f"tests/{t.name}" for t in tests]
    (ws / "pyproject.toml").write_text(
        PYPROJECT.format(only=json.dumps(only), tests=json.dumps(selection))
    )
    return ws


def tally(ws: Path) -> tuple[dict[str, Counter[str]], list[str]]:
    """Per mutated file: mutant statuses; and the names of the survivors."""
    per_file: dict[str, Counter[str]] = {}
    survivors = []
    for meta in sorted((ws / "mutants" / "src").rglob("*.py.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        rel = str(meta.relative_to(ws / "mutants"))[: -len(".meta")]
        counts = per_file.setdefault(rel, Counter())
        for key, code in codes.items():
            status = STATUS.get(code, "not checked" if code is None else "suspicious")
            if status == "not checked":  # outside the sample
                continue
            counts[status] += 1
            if status == "survived":
                survivors.append(key)
    return per_file, survivors


def rate(counts: Counter[str]) -> tuple[int, int]:
    """(killed, tested): timeouts count as killed; untested mutants (no tests reach them) count
    as tested and not killed, since no test would notice them."""
    killed = counts["killed"] + counts["timeout"]
    tested = sum(n for status, n in counts.items() if status not in ("skipped", "not checked"))
    return killed, tested


def run_target(
    name: str, target: Target, max_children: int, patterns: list[str], sample: int
) -> str:
    ws = prepare(name, target)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILES_")}
    env |= {"CI": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.monotonic()
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)]
    log = []
    if not patterns and sample:
        # Generate the mutants and collect which tests reach which function, running none (the
        # pattern matches no mutant); then run an even spread of `sample` of them.
        proc = subprocess.run([*cmd, "none-*"], cwd=ws, env=env, capture_output=True, text=True)
        log.append(proc.stdout + proc.stderr)
        names = sorted(
            key
            for meta in (ws / "mutants" / "src").rglob("*.py.meta")
            for key in json.loads(meta.read_text()).get("exit_code_by_key", {})
        )
        stride = max(len(names) / sample, 1.0)
        patterns = sorted({names[int(i * stride)] for i in range(min(sample, len(names)))})
        print(f"== {name}: {len(patterns)} of {len(names)} mutants", flush=True)
    proc = subprocess.run([*cmd, *patterns], cwd=ws, env=env, capture_output=True, text=True)
    log.append(proc.stdout + proc.stderr)
    (ws / "mutmut.log").write_text("\n".join(log))
    elapsed = time.monotonic() - start
    per_file, survivors = tally(ws)
    if not per_file:
        raise SystemExit(f"{name}: mutmut produced no results; see {ws / 'mutmut.log'}")
    lines = [f"## {name}: {target.summary} ({elapsed / 60:.1f} min)"]
    total: Counter[str] = Counter()
    for path, counts in per_file.items():
        total += counts
        killed, tested = rate(counts)
        pct = 100 * killed / tested if tested else 100.0
        detail = ", ".join(f"{s} {n}" for s, n in sorted(counts.items()))
        lines.append(f"  {path}: {killed}/{tested} killed ({pct:.1f}%)  [{detail}]")
    killed, tested = rate(total)
    lines.append(f"  TOTAL {name}: {killed}/{tested} killed ({100 * killed / max(tested, 1):.1f}%)")
    lines += [f"  survived: {s}" for s in survivors]
    report = "\n".join(lines)
    (ws / "report.txt").write_text(report + "\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)}; default: all")
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    parser.add_argument("--max-children", type=int, default=2, help="parallel mutants (2)")
    parser.add_argument(
        "--sample",
        type=int,
        default=80,
        help="run an even spread of this many mutants per target (80); 0: all of them",
    )
    parser.add_argument(
        "--mutants", nargs="*", default=[], help="mutmut name globs: run only these mutants"
    )
    args = parser.parse_args()
    if args.list:
        for name, t in TARGETS.items():
            print(
                f"{name}: {t.summary}\n  mutates {', '.join(t.mutate)}\n  tests {', '.join(t.tests)}"
            )
        return
    if unknown := set(args.targets) - set(TARGETS):
        parser.error(f"unknown target(s) {sorted(unknown)}; the targets: {', '.join(TARGETS)}")
    ensure_mutmut()
    reports = [
        run_target(name, TARGETS[name], args.max_children, args.mutants, args.sample)
        for name in args.targets or TARGETS
    ]
    print("\n\n".join(reports))


if __name__ == "__main__":
    main()
