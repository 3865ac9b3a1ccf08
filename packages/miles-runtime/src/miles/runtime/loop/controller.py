"""The controller: starts Ray and the actors, then runs the RL loop.

    rollout manager ─▶ buffer ─▶ train group ─▶ weight update ─▶ engine group

One loop serves every mode: take batch s from the buffer, train on it, send the new weights. What
differs between sync, one_step_off and async is the buffer policy the rollout manager applies
(how far ahead rollout may run, and how old a sample may be); see `buffer.BufferPolicy`.

Faults: the engine group restarts engines itself (and a weight sync that lost one is redone). A
train rank that dies makes the controller restart the whole train group from the newest snapshot
or checkpoint, redo the steps since from the batches it kept, and train the failed step again
(see `snapshots`). Restarts back off and are capped (`fault`).

The controller holds no model and imports no torch. Batches go to the train ranks once, through
Ray's object store; weights go from the train ranks to the engines.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import ray
import structlog
from ray import ObjectRef
from ray.actor import ActorMethod

from miles.core.config import RunConfig
from miles.core.contracts.components import Capability, Kind
from miles.core.contracts.types import PackedBatch, RunInfo
from miles.core.observability.telemetry import carrier, span
from miles.core.registry.plugins import get_plugin_manager
from miles.runtime.actors.train_group import (
    TrainerDied,
    TrainGroup,
    TrainGroupFailedError,
    retrying,
)
from miles.runtime.cluster.placement import Placement, cluster_gpu_memory_gb, start_ray
from miles.runtime.loop import checkpoints
from miles.runtime.loop.interrupts import GracefulInterrupt, RunInterrupted
from miles.runtime.loop.metric_log import MetricLog
from miles.runtime.loop.progress import Progress
from miles.runtime.loop.snapshots import RestorePoint, Snapshots
from miles.runtime.loop.warmstart import warm_start
from miles.runtime.loop.weight_updates import WeightSyncError, WeightUpdater
from miles.runtime.planning.planner import colocated_offload
from miles.runtime.rundir import SkippedCheckpoint, drop_rows_after, scan_checkpoints

if TYPE_CHECKING:
    from miles.runtime.rollout.rollout_manager import RolloutHandle

log = structlog.get_logger(__name__)
T = TypeVar("T")


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    final_metrics: dict[str, float]


class Controller:
    def __init__(
        self,
        config: RunConfig,
        run_dir: Path,
        *,
        ray_address: str | None = None,
        resume: bool = False,
    ) -> None:
        self.config, self.run_dir = config, run_dir
        self.ray_address, self.resume = ray_address, resume
        self.plugins = get_plugin_manager()
        self.info = RunInfo(
            run_id=uuid.uuid4().hex[:12],
            name=config.name,
            run_dir=str(run_dir),
            config=config.to_dict(),
        )
        self.resume_from: tuple[int, Path] | None = None
        # Newer checkpoints that did not verify, when resuming: said in the final summary and
        # (as `checkpoint_skipped` faults in events.jsonl) in the report.
        self.skipped_checkpoints: list[SkippedCheckpoint] = []
        if resume:
            self.resume_from, self.skipped_checkpoints = scan_checkpoints(run_dir)
            if self.resume_from is None:
                why = "; ".join(f"{s.path.name}: {s.problem}" for s in self.skipped_checkpoints)
                raise FileNotFoundError(
                    f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}"
                    + (f" ({why})" if why else "")
                )
            state = json.loads((self.resume_from[1] / "state.json").read_text())
            if state.get("numbering") != "steps_done":
                raise FileNotFoundError(
                    f"--resume: {self.resume_from[1]} was written by an earlier Miles, which "
                    "numbered steps from 0; this one numbers them from 1 and cannot resume it: "
                    "resume it with the Miles that wrote it, or start a new run"
                )
            for s in self.skipped_checkpoints:
                lost = s.step - self.resume_from[0]
                log.warning(
                    f"--resume: checkpoint {s.path.name} skipped ({s.problem}); resuming from "
                    f"step_{self.resume_from[0]}, {lost} step{'' if lost == 1 else 's'} lost",
                    fault="checkpoint_skipped",
                    checkpoint=str(s.path),
                    problem=s.problem,
                    steps_lost=s.step - self.resume_from[0],
                )
            # Steps after the checkpoint run again: their old records go (before sinks open).
            for name in ("metrics.jsonl", "samples.jsonl"):
                drop_rows_after(run_dir / name, self.resume_from[0])
        self.metrics = MetricLog(config.telemetry, run_dir)
        self.colocated = config.placement == "colocated"
        # Colocated: whether the hand-over moves memory off the GPU, by the memory plan (decided
        # once Ray is up: the GPUs are the cluster's, not necessarily this machine's).
        self.offload = False
        self.snapshots = Snapshots(config.fault, self.info.run_id, run_dir)
        self.step = -1  # the step under way (-1: before RL step 0)
        self.done_through = -1  # the last step trained, synced and snapshotted
        self.warmed = False  # the warm-start trained the policy
        self.steps_redone = 0
        self.loop_start: float | None = None  # when the first step began (perf_counter)
        self.eval_s = 0.0  # time spent evaluating since then

    # ── set-up ───────────────────────────────────────────────────────────────────────────────────

    def _start(self) -> None:
        start_ray(self.config, self.ray_address)
        if self.colocated:
            on_gpus = self.config.cluster.device != "cpu"
            gpu_mem = self.config.planner.gpu_mem_gb or (
                cluster_gpu_memory_gb() if on_gpus else None
            )
            self.offload, why = colocated_offload(self.config, gpu_mem)
            log.info("colocated hand-over", offload=self.offload, reason=why)
        placement = Placement.create(self.config, str(self.run_dir))
        self.placement = placement
        self.rollout, self.engines = placement.rollout, placement.engines
        self.trainers = TrainGroup(placement.train_launcher, placement.trainers, self.config.fault)
        self.weights = WeightUpdater(
            self.config, self.trainers, self.engines, self.rollout, self.colocated
        )
        self.weights.make_plan()
        log.info(
            "actors ready",
            trainers=len(self.trainers.trainers),
            engines=self.config.rollout.engines,
            placement=self.config.placement,
            sync_bytes=self.weights.plan.num_bytes,
        )
        if self.offload:  # the trainer goes first (warm-start)
            ray.get(self.engines.release_memory.remote())

    # ── weights and faults ───────────────────────────────────────────────────────────────────────

    def sync_weights(self, step: int, *, new_version: bool = True) -> dict[str, float]:
        metrics = self.weights.sync(step, new_version=new_version)
        self.plugins.call_lifecycle(
            "miles_after_weight_sync",
            run=self.info,
            step=step,
            version=self.weights.version,
            metrics=metrics,
        )
        return metrics

    def _sync_after_train(self, step: int, *, new_version: bool = True) -> dict[str, float]:
        """Weights to the engines; colocated, the trainer then hands the GPU back to them."""
        if self.offload:
            ray.get(self.engines.resume_memory.remote())
        metrics = self.sync_weights(step, new_version=new_version) if new_version else {}
        if self.colocated:
            if self.offload:
                self.trainers.sleep()
            ray.get(self.rollout.open.remote())
        return metrics

    def _recover_trainers(self, error: TrainerDied) -> None:
        """A new train group from the newest snapshot or checkpoint, brought forward to where
        the old one was by training the kept batches again. With nothing to restore, the run
        fails, unless `fault.train_restart_from: base` accepts going back to model.path; then
        the base weights go out as a new version, so samples made from the lost updates count
        as stale."""
        nothing_trained = self.done_through < 0 and not self.warmed
        point = self.snapshots.restore_point(nothing_trained)
        missing = [] if point is None else self._missing_batches(point)
        rewind = point is None or bool(missing)
        if rewind and self.config.fault.train_restart_from != "base":
            where = "no snapshot or checkpoint" if point is None else point.describe()
            raise TrainGroupFailedError(
                f"a train rank died at step {self.step + 1}, and its training cannot be restored: "
                f"{where} to resume from"
                + (f" with the batches of steps {[m + 1 for m in missing]}" if missing else "")
                + ". Keep snapshots on (fault.snapshot_every), checkpoint more often "
                "(checkpoint.every), or set fault.train_restart_from: base to start again from "
                f"model.path; last error: {error}"
            ) from error.cause
        if rewind:
            point = RestorePoint(-1, None, "base")
        assert point is not None
        self.trainers.restart(error, point.path)
        self.weights.make_plan()
        ray.get(self.engines.reset_sync_group.remote())  # its rank 0 is gone
        redone = 0 if rewind else self._redo(point.step + 1, self.done_through)
        self.steps_redone += redone
        log.warning(
            "train group restored",
            fault="train_restarted",
            step=self.step + 1,
            restored=point.describe(),
            steps_redone=redone,
            lost_training=rewind,
        )
        if rewind:
            self._sync_after_train(point.step)

    def _missing_batches(self, point: RestorePoint) -> list[int]:
        steps = range(point.step + 1, self.done_through + 1)
        return [s for s in steps if s not in self.snapshots.batches]

    def _redo(self, first: int, last: int) -> int:
        """Trains steps first..last again on their kept batches; how many."""
        for step in range(first, last + 1):
            batch = self.snapshots.batches[step]
            if batch is not None:  # None: that step had nothing to train
                self.trainers.train(batch, step, carrier())
        return max(0, last - first + 1)

    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        return retrying(what, fn, self._recover_trainers)

    def _rollout_result(self, ref: ObjectRef[T]) -> T:
        """The rollout side's answer (a batch's metrics, its state, an evaluation, its close),
        which may wait on generation: meanwhile, brings in engines restarted while no engine
        was left to generate (a weight sync re-sends the current version). Without this, a
        wait for generation and the next weight sync would each wait for the other."""
        while not ray.wait([ref], timeout=1.0)[0]:
            if ray.get(self.engines.needs_recovery.remote()):
                log.info("every engine was restarted; re-sending the current weights")
                self._retrying(
                    "engine recovery",
                    lambda: self.sync_weights(self.weights.synced_through, new_version=False),
                )
        return ray.get(ref)

    # ── stages ───────────────────────────────────────────────────────────────────────────────────

    def warmstart(self) -> None:
        """The optional SFT stage (see `warmstart`)."""
        if self.config.warmstart.steps:
            self.steps_redone += warm_start(self.config.warmstart, self.trainers, self.rollout)
            self.warmed = True

    def evaluate(self, step: int) -> dict[str, float]:
        if not self.config.eval.data:
            return {}
        t0 = time.perf_counter()
        metrics = self._rollout_result(self.rollout.evaluate.remote(step, carrier()))
        self.eval_s += time.perf_counter() - t0
        # Under eval/: a row of evaluation alone is not a training step (`miles report`).
        metrics["eval/train_elapsed_s"] = self.train_elapsed()
        log.info("eval", step=step, **{k: round(v, 4) for k, v in metrics.items()})
        return metrics

    def train_elapsed(self) -> float:
        """Seconds since the first step began, less the time spent evaluating: the clock of a
        time-to-accuracy comparison."""
        if self.loop_start is None:
            return 0.0
        return time.perf_counter() - self.loop_start - self.eval_s

    def checkpoint(self, step: int) -> None:
        """Checkpoint after the step of index `step`: `checkpoints/step_{step + 1}`, named by the
        steps done, as metrics.jsonl numbers them."""
        path = checkpoints.save(
            self.run_dir,
            step + 1,
            self.weights.version,
            self.trainers,
            self.rollout,
            self.engines,
            self.config.checkpoint,
            self._rollout_result,
        )
        self.snapshots.checkpointed(step)
        self.plugins.call_lifecycle(
            "miles_after_checkpoint", run=self.info, step=step, path=str(path)
        )

    def _restore(self) -> int:
        """Loads the newest valid checkpoint; returns the first step still to run."""
        assert self.resume_from is not None
        done, path = self.resume_from  # step_k: k steps done; the next step's index is k
        state = checkpoints.restore(path, self.trainers, self.rollout, self.engines)
        self.done_through = done - 1
        self.weights.version = int(state["weight_version"]) - 1
        # Engines hold the base model: bring them to the checkpoint.
        self._sync_after_train(done - 1)
        log.info("resumed", checkpoint=str(path), next_step=done + 1)
        return done

    def _first_sync(self) -> None:
        """Before RL step 0: the warm-start, then the engines get the trainer's weights."""
        cfg = self.config
        # A quantizing precision: engines loaded model.path as it is on disk, and must get the
        # format's weights before they generate.
        precision = self.plugins.get(Kind.PRECISION, cfg.precision.name).spec
        quantized = precision.has(Capability.QUANTIZED)
        if cfg.rollout.verify_weights and not (self.colocated or quantized):
            try:
                self.weights.verify()  # both sides loaded model.path: they must agree
            except WeightSyncError:
                raise
            except Exception as exc:  # an engine died: its replacement is synced when back
                log.warning("engines not verified at start", error=repr(exc)[:300])
        self.warmstart()
        if self.warmed and self.snapshots.enabled:  # a train group lost from here keeps it
            self._retrying("snapshot", lambda: self.snapshots.take(self.trainers, -1))
        new_version = bool(cfg.warmstart.steps) or quantized
        self._retrying("weight sync", lambda: self._sync_after_train(-1, new_version=new_version))

    # ── the loop ─────────────────────────────────────────────────────────────────────────────────

    def run(self) -> RunResult:
        cfg = self.config
        self.plugins.call_lifecycle("miles_on_run_start", run=self.info)
        status, error, final = "failed", None, {}
        try:
            with span("miles.run", run_id=self.info.run_id, name=cfg.name):
                with span("miles.setup"):
                    self._start()
                start = self._restore() if self.resume else 0
                if start == 0:
                    self._first_sync()
                ray.get(self.rollout.start.remote(start, self.weights.version, carrier()))
                if start == 0 and cfg.eval.at_start:
                    self.metrics.log(0, self.evaluate(0))
                progress = Progress(cfg.steps, start, enabled=cfg.telemetry.progress)
                self.loop_start, self.eval_s = time.perf_counter(), 0.0
                interrupt = GracefulInterrupt(progress.write, lambda: self.step + 1)
                try:
                    with interrupt:
                        for step in range(start, cfg.steps):
                            final = self.one_step(step)
                            progress.update(final)
                            last = step == cfg.steps - 1
                            if self._checkpoint_due(step) or (interrupt.requested and not last):
                                self._retrying(
                                    "checkpoint", functools.partial(self.checkpoint, step)
                                )
                            if interrupt.requested and not last:
                                raise self._interrupted(step)
                finally:
                    progress.close()
                if (
                    cfg.steps
                    and cfg.checkpoint.at_end
                    and not (cfg.checkpoint.every and cfg.steps % cfg.checkpoint.every == 0)
                ):
                    self._retrying("checkpoint", lambda: self.checkpoint(cfg.steps - 1))
                end_eval = self.evaluate(cfg.steps)
                if end_eval:
                    final = {**final, **end_eval}
                    self.metrics.log(cfg.steps, end_eval)
            status = "completed"
            # The summary counts every engine fault of the run, also one after the last batch.
            faults = ray.get(self.engines.fault_counts.remote())
            final = {**final, **faults}
            return RunResult(self.run_dir, cfg.steps, final)
        except (KeyboardInterrupt, RunInterrupted):
            status = "interrupted"
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.plugins.call_lifecycle(
                "miles_on_run_end", run=self.info, status=status, error=error
            )
            self.metrics.close()
            self.snapshots.close()
            if ray.is_initialized():
                self._flush_actor_traces()

    def _interrupted(self, step: int) -> RunInterrupted:
        """Stopping at a person's request after `step` (checkpointed): said in the events."""
        checkpoint = str(checkpoints.step_dir(self.run_dir, step + 1))
        log.warning(
            "run interrupted", steps_done=step + 1, steps=self.config.steps, checkpoint=checkpoint
        )
        return RunInterrupted(step + 1, self.config.steps, checkpoint)

    def _checkpoint_due(self, step: int) -> bool:
        every = self.config.checkpoint.every
        return bool(every) and (step + 1) % every == 0

    def one_step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.step = step
        # Steps are numbered from 1 wherever they are seen (metrics, samples, checkpoints, spans,
        # events, the bar): `step` is the loop's index, step + 1 the step's number.
        with span("miles.step", step=step + 1, run_id=self.info.run_id):
            # The batch goes from the rollout manager to the train ranks through the object store;
            # the controller only reads the small metrics dict.
            batch_ref, metrics_ref = _take(self.rollout, step, carrier())
            metrics = self._rollout_result(metrics_ref)
            metrics["perf/rollout_wait_s"] = time.perf_counter() - t0
            if self.plugins.has_impls("miles_after_rollout"):
                samples = ray.get(batch_ref).to_samples()
                self.plugins.call_lifecycle(
                    "miles_after_rollout",
                    run=self.info,
                    step=step,
                    samples=samples,
                    metrics=metrics,
                )
            t1 = time.perf_counter()

            def train_and_sync() -> None:
                if self.colocated:
                    self._rollout_result(self.rollout.close.remote())
                if self.offload:
                    ray.get(self.engines.release_memory.remote())
                    self.trainers.wake()
                trains = bool(metrics["rollout/kept_samples"])
                if trains:
                    metrics.update(self.trainers.train(batch_ref, step, carrier()))
                metrics["perf/train_s"] = time.perf_counter() - t1
                self.snapshots.trained(step, batch_ref if trains else None, metrics["perf/train_s"])
                metrics.update(self._sync_after_train(step))
                if self.snapshots.due() and not self._checkpoint_due(step):
                    metrics.update(self.snapshots.take(self.trainers, step))
                self.done_through = step

            self._retrying(f"step {step}", train_and_sync)
            self.plugins.call_lifecycle(
                "miles_after_train_step", run=self.info, step=step, metrics=metrics
            )
            if self.config.eval.every and (step + 1) % self.config.eval.every == 0:
                metrics.update(self.evaluate(step + 1))
        metrics["perf/step_s"] = time.perf_counter() - t0
        metrics["time/train_elapsed_s"] = self.train_elapsed()
        metrics["perf/tokens_per_s"] = metrics["rollout/tokens"] / metrics["perf/step_s"]
        metrics["perf/trainer_idle_frac"] = 1.0 - metrics["perf/train_s"] / metrics["perf/step_s"]
        metrics["fault/train_restarts"] = float(self.trainers.restarts)
        metrics["fault/steps_redone"] = float(self.steps_redone)
        self.metrics.log(step + 1, metrics)
        return metrics

    def _flush_actor_traces(self) -> None:
        with contextlib.suppress(Exception):  # best effort at shutdown
            ray.get(
                [
                    *self.trainers.flush(),
                    self.rollout.flush.remote(),
                    self.engines.flush.remote(),
                ],
                timeout=30,
            )


def _take(
    rollout: RolloutHandle, step: int, trace: dict[str, str]
) -> tuple[ObjectRef[PackedBatch], ObjectRef[dict[str, float]]]:
    """`RolloutManager.take`, its batch and its metrics as two refs. Ray's typing has no
    `.options(...)`: mypy checks the arguments through the plain call under TYPE_CHECKING, and
    the two-ref call is cast."""
    if TYPE_CHECKING:
        rollout.take.remote(step, trace)
    batch, metrics = cast(ActorMethod, rollout.take).options(num_returns=2).remote(step, trace)
    return batch, metrics
