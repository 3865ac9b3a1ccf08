"""The train group: every rank of the train backend, called together, restarted together.

A rank that dies makes the whole group restart (a new rendezvous), with capped, doubling back-off
(`fault.max_train_restarts`, `fault.backoff_s`); the controller says what state it loads (a
snapshot or a checkpoint, see `snapshots`).

Each operation of the train ranks has its method here, typed as `TrainActor`'s: every rank runs
it (the backends' collectives need all of them), and a rank's death surfaces as `TrainerDied`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import ray
import structlog
from ray import ObjectRef
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from miles.core.config import FaultConfig
from miles.core.contracts.types import PackedBatch
from miles.core.contracts.weight_sync import SyncPlan
from miles.runtime.cluster.placement import TrainLauncher
from miles.runtime.cluster.process import kill_actor

if TYPE_CHECKING:
    from miles.runtime.actors.engine_actor import EngineHandle
    from miles.runtime.actors.train_actor import TrainHandle

log = structlog.get_logger(__name__)
T = TypeVar("T")


class TrainGroupFailedError(RuntimeError):
    """The train group died more often than fault.max_train_restarts allows."""


class TrainerDied(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class TrainGroup:
    def __init__(
        self, launcher: TrainLauncher, trainers: list[TrainHandle], fault: FaultConfig
    ) -> None:
        self.launcher, self.trainers, self.fault = launcher, trainers, fault
        self.restarts = 0

    # ── training ─────────────────────────────────────────────────────────────────────────────────

    def train(
        self, batch: ObjectRef[PackedBatch], step: int, trace: dict[str, str]
    ) -> dict[str, float]:
        """One RL step on `batch` (`TrainActor.train`); its metrics."""
        return self._on_every_rank(lambda t: t.train.remote(batch, step, trace))

    def warmstart_step(
        self, batch: ObjectRef[PackedBatch], step: int, trace: dict[str, str]
    ) -> dict[str, float]:
        """One supervised warm-start step on `batch`; its metrics."""
        return self._on_every_rank(lambda t: t.warmstart_step.remote(batch, step, trace))

    # ── weights ──────────────────────────────────────────────────────────────────────────────────

    def sync_plan(self, bucket_bytes: int) -> SyncPlan:
        return self._on_every_rank(lambda t: t.sync_plan.remote(bucket_bytes))

    def sync_address(self) -> tuple[str, int]:
        """Where a new weight-sync group meets: rank 0's answer, asked of rank 0 alone (not a
        collective; a dead rank 0 raises Ray's error, as any failed sync step does)."""
        return ray.get(self.trainers[0].sync_address.remote())

    def join_sync(self, host: str, port: int, world_size: int) -> None:
        self._on_every_rank(lambda t: t.join_sync.remote(host, port, world_size))

    def leave_sync(self) -> None:
        self._on_every_rank(lambda t: t.leave_sync.remote())

    def send_weights(self, plan: SyncPlan, version: int, trace: dict[str, str]) -> int:
        """The weights to the engines' sync group; bytes sent."""
        return self._on_every_rank(lambda t: t.send_weights.remote(plan, version, trace))

    def send_weights_in_place(
        self,
        plan: SyncPlan,
        version: int,
        engines: list[EngineHandle | None],
        trace: dict[str, str],
    ) -> int:
        """Colocated: rank r's buckets to `engines[r]`; bytes handed over."""
        return self._on_every_rank(
            lambda t: t.send_weights_in_place.remote(plan, version, engines, trace)
        )

    def checksum(self, dtype: str | None) -> str:
        """The weights' hash as engines holding `dtype` should report it."""
        return self._on_every_rank(lambda t: t.checksum.remote(dtype))

    def sleep(self) -> None:
        self._on_every_rank(lambda t: t.sleep.remote())

    def wake(self) -> None:
        self._on_every_rank(lambda t: t.wake.remote())

    # ── state ────────────────────────────────────────────────────────────────────────────────────

    def save(self, path: str, trace: dict[str, str]) -> None:
        self._on_every_rank(lambda t: t.save.remote(path, trace))

    def load(self, path: str) -> None:
        self._on_every_rank(lambda t: t.load.remote(path))

    def _on_every_rank(self, call: Callable[[TrainHandle], ObjectRef[T]]) -> T:
        """`call` on every rank; rank 0's answer. A dead rank: TrainerDied, also when a live
        rank's error is the first to arrive (its collective broke when a peer died: gloo's
        "Connection closed by peer")."""
        refs = [call(t) for t in self.trainers]
        try:
            return ray.get(refs)[0]
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            raise TrainerDied(exc) from exc
        except Exception:
            death = _rank_death(refs)
            if death is not None:
                raise TrainerDied(death) from death
            raise

    # ── restarts ─────────────────────────────────────────────────────────────────────────────────

    def restart(self, error: TrainerDied, state: Path | None) -> None:
        """Replaces every rank, and loads the train `state` (None: model.path) into the new
        group."""
        if self.restarts >= self.fault.max_train_restarts:
            raise TrainGroupFailedError(
                f"a train rank died and the train group was already restarted "
                f"{self.restarts} times (fault.max_train_restarts="
                f"{self.fault.max_train_restarts}); last error: {error}"
            ) from error.cause
        delay = min(self.fault.backoff_s * 2**self.restarts, self.fault.backoff_max_s)
        self.restarts += 1
        log.warning(
            "a train rank died; restarting the train group",
            restart=self.restarts,
            in_s=delay,
            error=str(error),
        )
        for trainer in self.trainers:
            with contextlib.suppress(Exception):
                kill_actor(trainer)
        time.sleep(delay)
        self.trainers = self.launcher.launch()
        if state is not None:
            self.load(str(state))

    def flush(self) -> list[ObjectRef[None]]:
        """Each rank's buffered spans on (refs to wait for, with a deadline, at shutdown)."""
        return [t.flush.remote() for t in self.trainers]


def _rank_death(refs: list[ObjectRef[T]], timeout_s: float = 60.0) -> RayActorError | None:
    """After one rank's call failed: the death of another rank, if one died (the others' calls
    end soon after a peer's death, with their own errors or the death)."""
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        try:
            ray.get(ref)
        except RayActorError as exc:
            return exc
        except Exception:  # that rank's own error, or its collective's
            continue
    return None


def retrying(what: str, fn: Callable[[], T], recover: Callable[[TrainerDied], None]) -> T:
    """Runs `fn`; if a train rank dies in it, `recover` (which may itself lose a rank again)
    and runs it again."""
    while True:
        try:
            return fn()
        except TrainerDied as exc:
            log.warning(f"train group lost during {what}")
            error = exc
            while True:
                try:
                    recover(error)
                    break
                except TrainerDied as again:
                    error = again
