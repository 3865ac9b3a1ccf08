"""A seeded arithmetic task: "What is 27 + 45? Answer with the number only." with the number as
the reference answer, and a held-out eval split that never appears in training.

Every problem of the chosen operations and operand sizes is enumerated once (two-digit addition
has 8,100), `eval_size` of them are drawn for eval with the seed, and training gets the rest in a
seeded order. Harder mixes are options:

    python -m miles.recipes.arithmetic OUT_DIR --ops + - '*' --digits 3

then `--set data.path=OUT_DIR/train.jsonl --set eval.data=OUT_DIR/eval.jsonl`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
TEMPLATE = "What is {a} {op} {b}? Answer with the number only."


def problems(ops: Sequence[str], digits: int) -> Iterable[tuple[int, str, int]]:
    """Every (a, op, b) with a and b of exactly `digits` digits, in a fixed order."""
    unknown = sorted(set(ops) - set(OPERATIONS))
    if unknown or not ops:
        raise ValueError(f"arithmetic: operations must be among {sorted(OPERATIONS)}, got {ops}")
    if not 1 <= digits <= 4:
        raise ValueError(f"arithmetic: digits must be 1 to 4, got {digits}")
    numbers = range(10 ** (digits - 1) if digits > 1 else 0, 10**digits)
    for op in ops:
        for a, b in itertools.product(numbers, numbers):
            yield a, op, b


def row(a: int, op: str, b: int) -> dict[str, str]:
    return {"prompt": TEMPLATE.format(a=a, op=op, b=b), "answer": str(OPERATIONS[op](a, b))}


def write_splits(
    out: Path,
    seed: int,
    ops: Sequence[str] = ("+",),
    digits: int = 2,
    eval_size: int = 256,
) -> dict[str, str]:
    """Writes `train.jsonl` and `eval.jsonl` (rows: prompt, answer) under `out`; returns their
    paths. Equal arguments give equal files."""
    every = list(problems(ops, digits))
    if eval_size >= len(every):
        raise ValueError(f"arithmetic: eval_size {eval_size} leaves no training problems")
    random.Random(seed).shuffle(every)
    splits = {"eval": every[:eval_size], "train": every[eval_size:]}
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, items in splits.items():
        path = out / f"{name}.jsonl"
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(row(*p)) + "\n" for p in items))
        tmp.replace(path)
        paths[name] = str(path)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path)
    parser.add_argument("--ops", nargs="+", default=["+"], help="among + - *")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_splits(args.out, args.seed, args.ops, args.digits, args.eval_size)
    print(json.dumps(paths))


if __name__ == "__main__":
    main()
