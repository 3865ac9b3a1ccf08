"""Train-state snapshots: what a train group that died resumes from.

Every `fault.snapshot_every` steps the train group saves its model and optimizer state, as it
would for a checkpoint, into host memory (`/dev/shm`; the temp dir where there is none, as on
macOS; or `fault.snapshot_dir`): a directory that outlives the train processes. Only the newest is kept. The batches trained
since the newest snapshot or checkpoint are kept too (as Ray object references), so a new train
group loads the newer of the two and redoes those steps from the same data: the run goes on as
if the failure had not happened, instead of going back to `model.path`.

"auto" takes one as often as keeps their cost within a tenth of the train time (every step when
a snapshot is that cheap; the cadence follows running means of both, so it adapts as the run
goes); a snapshot that does not fit in the free host memory turns them off.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
from ray import ObjectRef

from miles.core.config import FaultConfig
from miles.core.contracts.types import PackedBatch
from miles.core.observability.telemetry import carrier, span
from miles.runtime.actors.train_group import TrainerDied, TrainGroup
from miles.runtime.rundir import latest_valid_checkpoint

log = structlog.get_logger(__name__)

# "auto": snapshots may cost this share of the train time.
_COST_SHARE = 0.1
# Weight of the newest value in the running means of snapshot and train seconds.
_EMA = 0.3


@dataclass(frozen=True)
class RestorePoint:
    step: int  # the last step whose update it holds (-1: before RL step 0)
    path: Path | None  # the train state to load; None: model.path
    source: str  # "snapshot", "checkpoint" or "base"

    def describe(self) -> str:
        return (
            "the base model" if self.path is None else f"the {self.source} of step {self.step + 1}"
        )


class Snapshots:
    def __init__(self, fault: FaultConfig, run_id: str, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.root = Path(fault.snapshot_dir or _host_memory()) / f"miles-snapshots-{run_id}"
        self.auto = fault.snapshot_every == "auto"
        self.every = 1 if fault.snapshot_every == "auto" else int(fault.snapshot_every)
        self.latest: RestorePoint | None = None
        # step -> its batch (None: nothing was trained)
        self.batches: dict[int, ObjectRef[PackedBatch] | None] = {}
        self._size = 0  # bytes of the newest snapshot
        self._since = 0  # steps trained since the newest snapshot
        self._snapshot_s: float | None = None  # running means
        self._train_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.every != 0

    def trained(self, step: int, batch: ObjectRef[PackedBatch] | None, train_s: float) -> None:
        """Step `step` trained on `batch` (an object reference) in `train_s`: the batch is kept
        until a restore point covers it."""
        self.batches[step] = batch
        self._since += 1
        self._train_s = _mean(self._train_s, train_s)

    def due(self) -> bool:
        return self.enabled and self._since >= self.every

    def take(self, trainers: TrainGroup, step: int) -> dict[str, float]:
        """Saves the train group's state after `step` (collective); the older one goes."""
        if self._size and shutil.disk_usage(self._parent()).free < 1.2 * self._size:
            self._turn_off(f"{self._parent()} has less than 1.2x a snapshot free")
            return {}
        t0 = time.perf_counter()
        final, tmp = self.root / f"step_{step}", self.root / f"tmp-step_{step}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            with span("miles.snapshot", step=step + 1):
                trainers.save(str(tmp), carrier())
            tmp.rename(final)
        except TrainerDied:
            raise
        except Exception as exc:  # e.g. no space left: the run goes on, on checkpoints
            shutil.rmtree(tmp, ignore_errors=True)
            self._turn_off(f"writing a snapshot failed: {exc!r}"[:300])
            return {}
        old, self.latest = self.latest, RestorePoint(step, final, "snapshot")
        if old is not None and old.path is not None:
            shutil.rmtree(old.path, ignore_errors=True)
        self._forget_through(step)
        seconds = time.perf_counter() - t0
        first = self._snapshot_s is None
        self._size = sum(f.stat().st_size for f in final.rglob("*") if f.is_file())
        self._since, self._snapshot_s = 0, _mean(self._snapshot_s, seconds)
        if self.auto and self._train_s:
            self.every = max(1, math.ceil(self._snapshot_s / (_COST_SHARE * self._train_s)))
        if first:
            log.info(
                "train snapshots",
                every="auto" if self.auto else self.every,
                snapshot_s=round(seconds, 4),
                mb=round(self._size / 2**20, 1),
                where=str(self.root),
            )
        return {"fault/snapshot_s": seconds, "fault/snapshot_every": float(self.every)}

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` is a restore point too: batches up to it are no longer needed."""
        self._forget_through(step)
        self._since = 0

    def restore_point(self, nothing_trained: bool) -> RestorePoint | None:
        """The newest of the snapshot and the latest valid checkpoint; the base model when
        nothing was trained yet; None when the train state cannot be restored."""
        found = latest_valid_checkpoint(self.run_dir)
        points = [p for p in (self.latest,) if p is not None]
        if found is not None:
            # step_k holds k steps; a restore point names the index of its last step.
            points.append(RestorePoint(found[0] - 1, found[1] / "train", "checkpoint"))
        if points:
            return max(points, key=lambda p: (p.step, p.source == "snapshot"))
        return RestorePoint(-1, None, "base") if nothing_trained else None

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _forget_through(self, step: int) -> None:
        for s in [s for s in self.batches if s <= step]:
            del self.batches[s]

    def _parent(self) -> Path:
        return self.root if self.root.exists() else self.root.parent

    def _turn_off(self, why: str) -> None:
        self.auto = False
        self.every = 0
        log.warning(
            "train snapshots turned off; a lost train group resumes from checkpoints",
            reason=why,
            fix="free host memory, or set fault.snapshot_dir to a larger file system",
        )


def _host_memory() -> str:
    """/dev/shm (a RAM-backed file system) where there is one; else (macOS) the temp dir."""
    return "/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir()


def _mean(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - _EMA) * mean + _EMA * value
