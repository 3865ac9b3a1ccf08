"""Train-state snapshots without Ray: the cadence ("auto" follows the cost), which batches are
kept for a redo, and which restore point a lost train group resumes from."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from miles.core.config import FaultConfig
from miles.runtime.loop.snapshots import Snapshots
from miles.runtime.rundir import atomic_checkpoint


class FakeTrainers:
    """`save(path, trace)` writes a file of `size` bytes, taking `seconds`."""

    def __init__(self, seconds: float = 0.0, size: int = 1000) -> None:
        self.seconds, self.size = seconds, size
        self.saved: list[str] = []

    def save(self, path: str, trace: Any) -> None:
        time.sleep(self.seconds)
        (Path(path) / "model.safetensors").write_bytes(b"\0" * self.size)
        self.saved.append(path)


def make(tmp_path: Path, every: int | str = "auto") -> Snapshots:
    fault = FaultConfig(snapshot_every=every, snapshot_dir=str(tmp_path / "shm"))  # type: ignore[arg-type]
    return Snapshots(fault, "run", tmp_path / "run")


def test_only_the_newest_snapshot_is_kept_with_the_batches_trained_since(tmp_path: Path) -> None:
    snaps, trainers = make(tmp_path, every=2), FakeTrainers()
    for step in range(5):
        snaps.trained(step, f"batch{step}", train_s=1.0)
        if snaps.due():
            snaps.take(trainers, step)  # type: ignore[arg-type]
    assert [Path(p).name for p in trainers.saved] == ["tmp-step_1", "tmp-step_3"]
    assert sorted(p.name for p in snaps.root.iterdir()) == ["step_3"]  # step_1 went
    assert snaps.batches == {4: "batch4"}  # what a redo from step 3 needs
    point = snaps.restore_point(nothing_trained=False)
    assert point is not None and (point.step, point.source) == (3, "snapshot")
    snaps.close()
    assert not snaps.root.exists()


def test_auto_takes_one_every_step_when_cheap_and_spaces_them_out_when_not(
    tmp_path: Path,
) -> None:
    cheap, slow = make(tmp_path / "a"), make(tmp_path / "b")
    for snaps, trainers in ((cheap, FakeTrainers(0.0)), (slow, FakeTrainers(0.05))):
        for step in range(3):
            snaps.trained(step, None, train_s=0.1)
            if snaps.due():
                snaps.take(trainers, step)  # type: ignore[arg-type]
    assert cheap.every == 1
    # 0.05 s per snapshot against 0.1 s per step: at most a tenth of the train time.
    assert slow.every >= 5


def test_a_newer_checkpoint_wins_and_nothing_restorable_is_none(tmp_path: Path) -> None:
    snaps = make(tmp_path, every=1)
    assert snaps.restore_point(nothing_trained=True).path is None  # type: ignore[union-attr]
    assert snaps.restore_point(nothing_trained=False) is None  # trained, nothing saved
    snaps.trained(0, "b0", train_s=1.0)
    snaps.take(FakeTrainers(), 0)  # type: ignore[arg-type]
    snaps.trained(1, "b1", train_s=1.0)
    with atomic_checkpoint(tmp_path / "run", 2) as tmp:  # step_2: after the step of index 1
        (tmp / "train").mkdir()
    snaps.checkpointed(1)
    point = snaps.restore_point(nothing_trained=False)
    assert point is not None and (point.step, point.source) == (1, "checkpoint")
    assert point.path == tmp_path / "run" / "checkpoints" / "step_2" / "train"
    assert snaps.batches == {}


def test_a_snapshot_that_cannot_be_written_turns_them_off(tmp_path: Path) -> None:
    snaps = make(tmp_path, every=1)
    (tmp_path / "shm").write_text("a file where the snapshot directory's parent should be")
    snaps.trained(0, "b0", train_s=1.0)
    assert snaps.take(FakeTrainers(), 0) == {}  # type: ignore[arg-type]
    assert not snaps.enabled and snaps.batches == {0: "b0"}  # still kept for a redo


def test_off_means_no_snapshots(tmp_path: Path) -> None:
    snaps = make(tmp_path, every=0)
    snaps.trained(0, "b0", train_s=1.0)
    assert not snaps.enabled and not snaps.due()
