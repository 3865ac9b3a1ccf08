"""Runs a function on N gloo CPU ranks (processes) and prints each rank's JSON result, one line
per rank in rank order (ranks write files: their prints would interleave on one pipe)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


def report(rank: int, result: dict[str, Any]) -> None:
    """Called by a rank with its result."""
    (Path(os.environ["MILES_RESULTS_DIR"]) / f"{rank}.json").write_text(json.dumps(result))


def spawn_and_print(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    with tempfile.TemporaryDirectory() as results:
        os.environ["MILES_RESULTS_DIR"] = results  # the spawned ranks inherit it
        mp.spawn(fn, args=args, nprocs=nprocs)
        for rank in range(nprocs):
            print((Path(results) / f"{rank}.json").read_text(), flush=True)
