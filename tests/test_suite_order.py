"""The suite's schedule: the files the root conftest starts first must exist. After a file moves
(a package split), a stale path silently drops that file to its collection place, and a long
file started last sets the suite's tail (the agent's learning run, 370 s, once did)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def longest_first() -> tuple[str, ...]:
    tree = ast.parse((ROOT / "conftest.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "LONGEST_FIRST" for t in node.targets
        ):
            return tuple(ast.literal_eval(node.value))
    raise AssertionError("conftest.py has no LONGEST_FIRST")


def test_every_file_started_first_exists() -> None:
    paths = longest_first()
    assert paths, "LONGEST_FIRST is empty"
    missing = [p for p in paths if not (ROOT / p).is_file()]
    assert not missing, f"LONGEST_FIRST names files that are not there: {missing}"
    assert len(set(paths)) == len(paths)
