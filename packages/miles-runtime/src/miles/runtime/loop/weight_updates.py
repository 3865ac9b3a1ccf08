"""Weight updates, driven by the controller: the trainer's weights to every alive engine.

A broadcast over a process group of rank 0 and the engines (rebuilt whenever its members changed),
or, colocated, each bucket handed to the engine on the same GPU. A sync that fails (an engine
died in it) is torn down on every side, the engine group restarts the dead engines (or drops
those past their restart budget), and the sync is done again with a new group of the live ones.
Afterwards the engines' weights are checked against the trainer's (`rollout.verify_weights`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ray
import structlog

from miles.core.config import RunConfig
from miles.core.contracts.weight_sync import SyncPlan
from miles.core.observability.telemetry import carrier, span
from miles.runtime.actors.train_group import TrainerDied, TrainGroup
from miles.runtime.rollout.buffer import BufferPolicy

if TYPE_CHECKING:
    from miles.runtime.actors.engine_group import EngineGroupHandle
    from miles.runtime.rollout.rollout_manager import RolloutHandle

log = structlog.get_logger(__name__)


class WeightSyncError(RuntimeError):
    pass


class WeightUpdater:
    def __init__(
        self,
        config: RunConfig,
        trainers: TrainGroup,
        engines: EngineGroupHandle,
        rollout: RolloutHandle,
        colocated: bool,
    ) -> None:
        self.config, self.trainers = config, trainers
        self.engines, self.rollout, self.colocated = engines, rollout, colocated
        # Batches in flight finish before an update, unless the policy pauses them (async). With
        # no lookahead (sync) none can be in flight: the next starts once the weights are out.
        policy = BufferPolicy.from_config(config)
        self.wait_for_batches = policy.lookahead > 0 and not policy.interrupt_on_update
        self.version = 0  # of the weights on the engines
        self.synced_through = -1  # the engines hold the weights made by this step
        self.plan = SyncPlan()
        self._engine_dtype: str | None = None

    def make_plan(self) -> None:
        """What engines receive (again after the train group restarted)."""
        self.plan = self.trainers.sync_plan(self.config.rollout.sync_bucket_mb * 2**20)

    def sync(self, step: int, *, new_version: bool = True) -> dict[str, float]:
        """The trainer's weights to every alive engine, as a new version (after training) or
        again as the current one (to bring restarted engines in)."""
        t0 = time.perf_counter()
        version = self.version + 1 if new_version else self.version
        synced_through = step if new_version else self.synced_through
        with span("miles.weight_sync", step=step + 1, version=version):  # after step + 1
            sent, send_s, verify_s = self._sync_verified(version, finish_batches=new_version)
            self.version, self.synced_through = version, synced_through
            # Together: batches the new version lets start queue until the engines resume.
            ray.get(
                [
                    self.engines.end_update.remote(),
                    self.rollout.weights_updated.remote(version, synced_through),
                ]
            )
        return {
            "weights/version": float(self.version),
            "weights/sync_bytes": float(sent),
            "perf/sync_s": time.perf_counter() - t0,
            # The transfer alone (gathers, buckets, loads), then the checksum comparison.
            "perf/sync_gbps": sent / max(send_s, 1e-9) / 1e9,
            "perf/sync_verify_s": verify_s,
        }

    def _sync_verified(self, version: int, *, finish_batches: bool) -> tuple[int, float, float]:
        """Sends the weights until every engine holds them: (bytes sent, send s, verify s).

        Engines stay paused throughout (they resume in `end_update`), so nothing is generated
        with weights that failed verification. A sync that broke (an engine died) is redone with
        the engines left; one that verified wrong is sent once more (a transient corruption),
        and stops the run with `WeightSyncError` if the engines still hold other weights.
        """
        # Each failed try costs an engine a restart (or drops it), so the tries are bounded.
        tries = (self.config.fault.max_engine_restarts + 1) * self.config.rollout.engines + 1
        resent = False
        failures = 0
        while True:
            try:
                t_send = time.perf_counter()
                sent = self._sync_once(version, finish_batches=finish_batches)
                send_s = time.perf_counter() - t_send
                t_verify = time.perf_counter()
                if self.config.rollout.verify_weights:
                    self.verify(version)  # an engine may die here too: then redo it all
                return sent, send_s, time.perf_counter() - t_verify
            except TrainerDied:
                raise  # a lost trainer is the controller's
            except WeightSyncError as exc:
                if resent:
                    raise WeightSyncError(
                        f"{exc}; also after the weights were sent again"
                    ) from None
                resent = True
                log.warning("engines hold other weights than sent; sending again", error=str(exc))
            except Exception as exc:
                failures += 1
                if failures >= tries:
                    raise WeightSyncError(
                        f"weight sync to version {version} failed {tries} times; see events.jsonl"
                    ) from exc
                log.warning("weight sync failed; redoing it", attempt=failures, error=repr(exc))
                self._tear_down()
            finish_batches = False  # the first try let them finish

    def _tear_down(self) -> None:
        """Every side leaves the broken group; then wait until dead engines are replaced."""
        self.trainers.leave_sync()
        ray.get(self.engines.abort_sync.remote())
        ray.get(self.engines.await_engines.remote())

    def _sync_once(self, version: int, *, finish_batches: bool) -> int:
        if finish_batches and self.wait_for_batches:
            ray.get(self.rollout.finish_in_flight.remote())
        rebuild = ray.get(self.engines.begin_update.remote())
        trace = carrier()
        if self.colocated:
            targets = ray.get(self.engines.in_place_targets.remote())
            return int(self.trainers.send_weights_in_place(self.plan, version, targets, trace))
        if rebuild:  # every member joins the new group at once
            host, port = self.trainers.sync_address()
            world = ray.get(self.engines.sync_world.remote())
            joined = self.engines.join_sync.remote(host, port)
            self.trainers.join_sync(host, port, world)
            ray.get(joined)
        receive = self.engines.receive_weights.remote(self.plan, version, trace)
        sent = self.trainers.send_weights(self.plan, version, trace)
        ray.get(receive)
        return int(sent)

    def verify(self, version: int | None = None) -> None:
        """Engines must hold exactly the trainer's weights, at `version` (default: the current
        one)."""
        version = self.version if version is None else version
        if self._engine_dtype is None:
            self._engine_dtype = str(ray.get(self.engines.weights_dtype.remote()))
        engines = self.engines.weights.remote()
        expected = self.trainers.checksum(self._engine_dtype)  # collective
        check_engine_weights(expected, version, [EngineWeights(*w) for w in ray.get(engines)])


@dataclass(frozen=True)
class EngineWeights:
    """What one engine holds, by its own account of the tensors it serves."""

    engine: int  # its index
    checksum: str
    version: int


def check_engine_weights(expected: str, version: int, engines: list[EngineWeights]) -> None:
    """Raises WeightSyncError naming each engine whose weights are not the trainer's (checksum
    `expected`) at `version`."""
    wrong = [e for e in engines if e.checksum != expected or e.version != version]
    if wrong:
        held = "; ".join(
            f"engine {e.engine} holds version {e.version} with checksum {e.checksum[:16]}"
            for e in wrong
        )
        raise WeightSyncError(
            f"weight sync verification failed at version {version}: {held}; the trainer's "
            f"checksum is {expected[:16]}"
        )
