"""Prompt datasets: rows in, deterministic epochs out, with a position that checkpoints save.

JSONL needs nothing beyond the standard library. Parquet files and hub datasets go through Hugging
Face `datasets` where it is installed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def read_rows(path: str, split: str = "train") -> list[dict[str, Any]]:
    """All rows of a .jsonl file, a .parquet file, or a hub dataset id."""
    if path.endswith((".jsonl", ".json")):
        return read_jsonl(path)
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{path}: reading Parquet or hub datasets needs Hugging Face `datasets`: "
            "pip install 'miles-runtime[datasets]' (or convert the file to JSONL)"
        ) from None
    if path.endswith(".parquet"):
        ds = datasets.load_dataset("parquet", data_files=path, split="train")
    else:
        ds = datasets.load_dataset(path, split=split)
    return [dict(row) for row in ds]


def read_jsonl(path: str) -> list[dict[str, Any]]:
    rows = []
    for lineno, row in rows_with_lines(path):
        if isinstance(row, str):
            raise ValueError(f"{path}:{lineno}: {row}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def rows_with_lines(path: str) -> Iterator[tuple[int, dict[str, Any] | str]]:
    """(line number, row) for each non-blank line, or (line number, what is wrong with it)."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield lineno, (f"not UTF-8: byte 0x{raw[exc.start]:02x} at column {exc.start + 1}")
                continue
            try:
                row = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as exc:
                yield lineno, f"not valid JSON: {exc.msg} (column {exc.colno})"
                continue
            if not isinstance(row, dict):
                yield lineno, f"a JSON {type(row).__name__}, not an object"
                continue
            yield lineno, row


@dataclass
class SourceState:
    epoch: int = 0
    index: int = 0  # position within the epoch's order


class PromptSource:
    """Walks rows in epochs; each epoch's order is a shuffle seeded by (seed, epoch)."""

    def __init__(self, rows: list[dict[str, Any]], *, seed: int, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("the prompt dataset is empty")
        self.rows, self.seed, self.shuffle = rows, seed, shuffle
        self.state = SourceState()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[dict[str, Any]]:
        """The next n rows, crossing into a new epoch when this one runs out."""
        out: list[dict[str, Any]] = []
        while len(out) < n:
            if self.state.index >= len(self._order):
                self.state = SourceState(self.state.epoch + 1, 0)
                self._order = self._epoch_order(self.state.epoch)
            out.append(self.rows[self._order[self.state.index]])
            self.state.index += 1
        return out

    def get_state(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "index": self.state.index}

    def set_state(self, state: dict[str, int]) -> None:
        self.state = SourceState(int(state["epoch"]), int(state["index"]))
        self._order = self._epoch_order(self.state.epoch)
