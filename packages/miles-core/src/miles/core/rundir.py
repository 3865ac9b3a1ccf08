"""The run directory: config.yaml, manifest.json, metrics.jsonl, traces.jsonl, events.jsonl,
checkpoints/. Checkpoints are atomic: written under a temporary name, fsynced, then renamed."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata as md
from pathlib import Path
from typing import Any

import yaml

CHECKPOINTS = "checkpoints"


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def write_config(run_dir: Path, config: dict[str, Any]) -> None:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def write_manifest(run_dir: Path, *, run_id: str, seed: int, plugins: list[dict[str, Any]]) -> None:
    def version(dist: str) -> str | None:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    manifest = {
        "run_id": run_id,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": version("torch"),
        "ray": version("ray"),
        "transformers": version("transformers"),
        "seed": seed,
        "command": sys.argv,
        "distributions": [
            {"name": p["name"], "version": p["version"], "status": p["status"]} for p in plugins
        ],
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_checkpoint(run_dir: Path, step: int) -> Iterator[Path]:
    """Yields a temporary directory; on success it becomes ``checkpoints/step_N`` in one rename."""
    root = run_dir / CHECKPOINTS
    root.mkdir(exist_ok=True)
    final, tmp = root / f"step_{step}", root / f".tmp-step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / CHECKPOINTS
    if not root.exists():
        return []
    found = []
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("step_") and (p / "state.json").exists():
            found.append((int(p.name.removeprefix("step_")), p))
    return sorted(found)


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    for _, path in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
