"""The run directory: config.yaml, manifest.json, metrics.jsonl, traces.jsonl, events.jsonl,
checkpoints/.

Checkpoints are atomic and self-verifying: each is written under a temporary name, gets a
`checksums.json` manifest (sha256 and size of every file), is fsynced, then renamed to
`checkpoints/step_N`. A crash leaves at most a `.tmp-step_N` directory, which is never loaded;
a checkpoint damaged later (truncated copy, bit rot, a file deleted by hand) fails
`verify_checkpoint`, and `latest_valid_checkpoint` falls back to an older one."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata as md
from pathlib import Path
from typing import Any

import structlog
import yaml

CHECKPOINTS = "checkpoints"
CHECKSUMS = "checksums.json"
_TMP_PREFIX = ".tmp-"

log = structlog.get_logger(__name__)


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


def add_to_manifest(run_dir: Path, **values: Any) -> None:
    """Sets keys of manifest.json (e.g. the actors' layout, known once they are placed)."""
    path = run_dir / "manifest.json"
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    manifest.update(values)
    path.write_text(json.dumps(manifest, indent=2) + "\n")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file, then every directory bottom-up, so each entry is durable before the
    rename that publishes the checkpoint."""
    paths = sorted(root.rglob("*"))
    for path in paths:
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in reversed(paths):
        if path.is_dir():
            _fsync_dir(path)
    _fsync_dir(root)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()  # streams; never the whole file


def _write_checksums(root: Path) -> None:
    files = {
        path.relative_to(root).as_posix(): {"sha256": _sha256(path), "bytes": path.stat().st_size}
        for path in sorted(root.rglob("*"))
        if path.is_file() and path != root / CHECKSUMS
    }
    (root / CHECKSUMS).write_text(json.dumps(files, indent=1) + "\n")


@contextmanager
def atomic_checkpoint(run_dir: Path, step: int) -> Iterator[Path]:
    """Yields a temporary directory to write into; when the body succeeds its checksums are
    written, everything is fsynced and it becomes ``checkpoints/step_N`` in one rename. When the
    body raises, the temporary directory is removed and nothing is published."""
    root = run_dir / CHECKPOINTS
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    if created:
        _fsync_dir(run_dir)
    final, tmp = root / f"step_{step}", root / f"{_TMP_PREFIX}step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        _write_checksums(tmp)
        _fsync_tree(tmp)
        if final.exists():  # re-saving a step: os.replace cannot overwrite a non-empty directory
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)  # make the rename itself durable
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def verify_checkpoint(path: Path) -> str | None:
    """None when every file in the checkpoint's ``checksums.json`` is present with its recorded
    size and sha256; otherwise a one-line description of the first problem. Files the manifest
    does not list are allowed."""
    manifest = path / CHECKSUMS
    if not path.is_dir():
        return "missing: not a directory"
    if not manifest.is_file():
        return f"partial: no {CHECKSUMS}"
    try:
        files = json.loads(manifest.read_text())
        entries = [(rel, int(e["bytes"]), str(e["sha256"])) for rel, e in files.items()]
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        return f"corrupt {CHECKSUMS}: {type(e).__name__}: {e}"
    for rel, size, _ in entries:
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts:
            return f"corrupt {CHECKSUMS}: bad path {rel!r}"
        file = path / rel
        if not file.is_file():
            return f"missing file {rel}"
        actual = file.stat().st_size
        if actual != size:  # cheap check first: truncation needs no hashing
            return f"size mismatch in {rel}: {actual} bytes, expected {size}"
    for rel, _, digest in entries:
        if _sha256(path / rel) != digest:
            return f"sha256 mismatch in {rel}"
    return None


def _step_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Every published ``step_N`` directory, oldest first, whatever its state."""
    root = run_dir / CHECKPOINTS
    if not root.exists():
        return []
    found = []
    for p in root.iterdir():
        suffix = p.name.removeprefix("step_")
        if p.is_dir() and p.name.startswith("step_") and suffix.isdigit():
            found.append((int(suffix), p))
    return sorted(found)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Published checkpoints with a ``state.json``, oldest first; their contents are not verified
    (see `latest_valid_checkpoint`)."""
    return [(step, p) for step, p in _step_dirs(run_dir) if (p / "state.json").exists()]


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint newer than the one a run resumes from, which did not verify."""

    step: int
    path: Path
    problem: str


def scan_checkpoints(run_dir: Path) -> tuple[tuple[int, Path] | None, list[SkippedCheckpoint]]:
    """The newest checkpoint that passes `verify_checkpoint` (None: none does), and each newer
    one that does not, newest first, with why."""
    skipped: list[SkippedCheckpoint] = []
    for step, path in reversed(_step_dirs(run_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return (step, path), skipped
        skipped.append(SkippedCheckpoint(step, path, problem))
    return None, skipped


def latest_valid_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint that passes `verify_checkpoint`; each newer one that does not is
    logged as a warning and skipped. None when no checkpoint verifies."""
    found, skipped = scan_checkpoints(run_dir)
    for s in skipped:
        log.warning(
            "checkpoint is corrupt or partial; using an older one",
            checkpoint=str(s.path),
            problem=s.problem,
        )
    return found


def prune_checkpoints(run_dir: Path, keep_last: int, keep_every: int = 0) -> None:
    """Delete old checkpoints: keep the newest ``keep_last`` (0 keeps all), every one whose
    ``step % keep_every == 0`` (``step_k``: after k steps; milestones, when ``keep_every > 0``), and always the newest
    one that verifies, so corrupt newer checkpoints never cost the last good one. Also removes
    leftover ``.tmp-*`` directories; do not call it while a checkpoint is being written."""
    root = run_dir / CHECKPOINTS
    if root.exists():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith(_TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
    if keep_last <= 0:
        return
    found = _step_dirs(run_dir)
    keep = {step for step, _ in found[-keep_last:]}
    if keep_every > 0:
        keep |= {step for step, _ in found if step % keep_every == 0}
    doomed = [(step, path) for step, path in found if step not in keep]
    if not doomed:
        return  # nothing to delete: skip hashing
    for step, path in reversed(found):  # newest first; usually the first one verifies
        if verify_checkpoint(path) is None:
            keep.add(step)
            break
    for step, path in doomed:
        if step not in keep:
            shutil.rmtree(path, ignore_errors=True)


def drop_rows_after(path: Path, step: int) -> None:
    """Keeps the JSON lines of `path` whose "step" is at most `step` (atomically)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", -1) <= step
    ]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)
