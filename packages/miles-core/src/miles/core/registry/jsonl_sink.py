"""Metric sinks that ship with the core."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


class JsonlSink:
    """Appends one JSON object per step to ``<run_dir>/metrics.jsonl``, flushed at once."""

    def __init__(self, run_dir: str) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items() if k != "step"}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
