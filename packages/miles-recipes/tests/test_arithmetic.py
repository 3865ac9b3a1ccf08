"""The arithmetic task's data: seeded, held-out eval disjoint from training, correct answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.recipes import arithmetic


def _rows(path: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_splits_are_seeded_disjoint_and_complete(tmp_path: Path) -> None:
    a = arithmetic.write_splits(tmp_path / "a", seed=3)
    b = arithmetic.write_splits(tmp_path / "b", seed=3)
    c = arithmetic.write_splits(tmp_path / "c", seed=4)
    assert Path(a["train"]).read_text() == Path(b["train"]).read_text()
    assert Path(a["eval"]).read_text() != Path(c["eval"]).read_text()
    train, held_out = _rows(a["train"]), _rows(a["eval"])
    assert len(held_out) == 256 and len(train) + len(held_out) == 90 * 90
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


@pytest.mark.parametrize("ops", [["+"], ["-"], ["*"], ["+", "-"]])
def test_answers_are_right(tmp_path: Path, ops: list[str]) -> None:
    paths = arithmetic.write_splits(tmp_path, seed=0, ops=ops, digits=1, eval_size=10)
    for row in _rows(paths["train"]) + _rows(paths["eval"]):
        a, op, b = row["prompt"].removeprefix("What is ").split("?")[0].split()
        assert op in ops
        assert int(row["answer"]) == {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}[op](
            int(a), int(b)
        )


def test_bad_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="operations must be among"):
        arithmetic.write_splits(tmp_path, seed=0, ops=["/"])
    with pytest.raises(ValueError, match="leaves no training problems"):
        arithmetic.write_splits(tmp_path, seed=0, digits=1, eval_size=100)
