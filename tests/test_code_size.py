"""One idea per file: no module under packages/*/src over 500 lines, no function over 100. A file
that grows past them holds several ideas; split it along them (docs/contributing.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for p in ROOT.glob("packages/*/src/**/*.py") if "__pycache__" not in p.parts)
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 100


def test_the_walk_sees_the_sources() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in SOURCES}
    assert "packages/miles-core/src/miles/core/cli.py" in names and len(names) > 200


def test_no_file_over_500_lines() -> None:
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in SOURCES
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_100_lines() -> None:
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
