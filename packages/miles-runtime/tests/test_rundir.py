"""Checkpoints: atomic publication, integrity manifests, fallback to the last good one, retention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from miles.runtime.rundir import (
    CHECKSUMS,
    atomic_checkpoint,
    latest_valid_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    verify_checkpoint,
)


def save(run_dir: Path, step: int) -> Path:
    """A checkpoint shaped like the controller's: state.json plus a nested trainer directory."""
    with atomic_checkpoint(run_dir, step) as tmp:
        (tmp / "train").mkdir()
        (tmp / "train" / "model.safetensors").write_bytes(bytes(range(256)) * 64 + bytes([step]))
        (tmp / "train" / "optim.json").write_text(json.dumps({"lr": 1e-6, "step": step}))
        (tmp / "state.json").write_text(json.dumps({"step": step}))
    return run_dir / "checkpoints" / f"step_{step}"


def test_manifest_lists_every_file_and_verifies(tmp_path: Path):
    path = save(tmp_path, 3)
    files = json.loads((path / CHECKSUMS).read_text())
    assert set(files) == {"state.json", "train/model.safetensors", "train/optim.json"}
    assert files["train/model.safetensors"]["bytes"] == 256 * 64 + 1
    assert all(len(entry["sha256"]) == 64 for entry in files.values())
    assert verify_checkpoint(path) is None
    (path / "notes.txt").write_text("added later")  # unlisted files are allowed
    assert verify_checkpoint(path) is None
    assert list_checkpoints(tmp_path) == [(3, path)]
    assert not (tmp_path / "checkpoints" / ".tmp-step_3").exists()


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-1])


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (flip_byte, "sha256 mismatch in train/model.safetensors"),
        (truncate, "size mismatch in train/model.safetensors"),
        (Path.unlink, "missing file train/model.safetensors"),
    ],
)
def test_damaged_file_is_detected(tmp_path: Path, damage, problem: str):
    path = save(tmp_path, 0)
    damage(path / "train" / "model.safetensors")
    found = verify_checkpoint(path)
    assert found is not None and found.startswith(problem), found


def test_checkpoint_without_manifest_is_partial(tmp_path: Path):
    # A crash after the files were written but before the manifest: what a copy interrupted
    # half-way, or a checkpoint from before manifests, looks like.
    path = save(tmp_path, 0)
    (path / CHECKSUMS).unlink()
    assert verify_checkpoint(path) == "partial: no checksums.json"
    (path / CHECKSUMS).write_text("{not json")
    assert verify_checkpoint(path).startswith("corrupt checksums.json")
    (path / CHECKSUMS).write_text(json.dumps({"../state.json": {"sha256": "0", "bytes": 1}}))
    assert verify_checkpoint(path).startswith("corrupt checksums.json: bad path")


def test_latest_valid_falls_back_and_warns(tmp_path: Path):
    for step in (1, 3, 5):
        save(tmp_path, step)
    assert latest_valid_checkpoint(tmp_path) == (5, tmp_path / "checkpoints" / "step_5")
    flip_byte(tmp_path / "checkpoints" / "step_5" / "train" / "model.safetensors")
    (tmp_path / "checkpoints" / "step_3" / CHECKSUMS).unlink()
    (tmp_path / "checkpoints" / ".tmp-step_7").mkdir()  # a crash mid-save: ignored
    with capture_logs() as logs:
        found = latest_valid_checkpoint(tmp_path)
    assert found == (1, tmp_path / "checkpoints" / "step_1")
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [(Path(e["checkpoint"]).name, e["problem"]) for e in warnings] == [
        ("step_5", "sha256 mismatch in train/model.safetensors"),
        ("step_3", "partial: no checksums.json"),
    ]
    assert all(e["event"] == "checkpoint is corrupt or partial; using an older one" for e in logs)
    (tmp_path / "checkpoints" / "step_1" / "state.json").unlink()
    assert latest_valid_checkpoint(tmp_path) is None
    assert latest_valid_checkpoint(tmp_path / "nowhere") is None


def test_crash_inside_body_publishes_nothing(tmp_path: Path):
    save(tmp_path, 0)
    with pytest.raises(RuntimeError, match="trainer died"), atomic_checkpoint(tmp_path, 1) as tmp:
        (tmp / "state.json").write_text("{}")
        raise RuntimeError("trainer died")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0"]
    assert latest_valid_checkpoint(tmp_path) == (0, tmp_path / "checkpoints" / "step_0")


def test_resaving_a_step_replaces_it(tmp_path: Path):
    path = save(tmp_path, 2)
    (path / "stale.bin").write_bytes(b"old")
    with atomic_checkpoint(tmp_path, 2) as tmp:
        (tmp / "state.json").write_text("{}")
    assert sorted(p.name for p in path.iterdir()) == [CHECKSUMS, "state.json"]
    assert verify_checkpoint(path) is None


def steps(run_dir: Path) -> list[int]:
    return sorted(
        int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").glob("step_*")
    )


def test_prune_keeps_last_and_milestones(tmp_path: Path):
    for step in range(1, 11):  # step_k: after k steps
        save(tmp_path, step)
    (tmp_path / "checkpoints" / ".tmp-step_11").mkdir()
    prune_checkpoints(tmp_path, keep_last=2, keep_every=5)
    assert steps(tmp_path) == [5, 9, 10]
    assert not (tmp_path / "checkpoints" / ".tmp-step_11").exists()
    prune_checkpoints(tmp_path, 1)  # the controller's positional call: keep_every defaults to 0
    assert steps(tmp_path) == [10]


def test_prune_zero_keeps_all(tmp_path: Path):
    for step in range(4):
        save(tmp_path, step)
    prune_checkpoints(tmp_path, keep_last=0, keep_every=3)
    assert steps(tmp_path) == [0, 1, 2, 3]


def test_prune_never_deletes_newest_valid(tmp_path: Path):
    for step in range(6):
        save(tmp_path, step)
    for step in (4, 5):  # the newest two are damaged: step 3 is the one a resume would use
        truncate(tmp_path / "checkpoints" / f"step_{step}" / "train" / "model.safetensors")
    prune_checkpoints(tmp_path, keep_last=2)
    assert steps(tmp_path) == [3, 4, 5]
    assert latest_valid_checkpoint(tmp_path)[0] == 3
