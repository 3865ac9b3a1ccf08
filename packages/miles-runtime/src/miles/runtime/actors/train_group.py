"""The train group: every rank of the train backend, called together, restarted together.

A rank that dies makes the whole group restart (a new rendezvous), with capped, doubling back-off
(`fault.max_train_restarts`, `fault.backoff_s`); the controller says what state it loads (a
snapshot or a checkpoint, see `snapshots`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import ray
import structlog
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from miles.core.config import FaultConfig
from miles.runtime.cluster.placement import TrainLauncher

log = structlog.get_logger(__name__)
T = TypeVar("T")


class TrainGroupFailedError(RuntimeError):
    """The train group died more often than fault.max_train_restarts allows."""


class TrainerDied(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


class TrainGroup:
    def __init__(self, launcher: TrainLauncher, trainers: list[Any], fault: FaultConfig) -> None:
        self.launcher, self.trainers, self.fault = launcher, trainers, fault
        self.restarts = 0

    def call(self, method: str, *args: Any) -> Any:
        """Calls `method` on every rank; rank 0's answer. A dead rank: TrainerDied, also when
        a live rank's error is the first to arrive (its collective broke when a peer died:
        gloo's "Connection closed by peer")."""
        refs = [getattr(t, method).remote(*args) for t in self.trainers]
        try:
            return ray.get(refs)[0]
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            raise TrainerDied(exc) from exc
        except Exception:
            death = _rank_death(refs)
            if death is not None:
                raise TrainerDied(death) from death
            raise

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
                ray.kill(trainer, no_restart=True)
        time.sleep(delay)
        self.trainers = self.launcher.launch()
        if state is not None:
            self.call("load", str(state))

    def flush(self) -> list[Any]:
        return [t.flush.remote() for t in self.trainers]


def _rank_death(refs: list[Any], timeout_s: float = 60.0) -> RayActorError | None:
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
