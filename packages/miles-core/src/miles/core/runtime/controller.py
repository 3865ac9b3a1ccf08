"""The controller: starts Ray and the actors, then runs the RL loop.

    rollout manager ─▶ buffer ─▶ train group ─▶ weight sync ─▶ engines

One loop serves every mode: take batch s from the buffer, train on it, send the new weights. What
differs between sync, one_step_off and async is the buffer policy the rollout manager applies
(how far ahead rollout may run, and how old a sample may be); see `buffer.BufferPolicy`.

Faults: the rollout manager restarts engines itself. A train rank that dies makes the controller
restart the whole train group from the latest valid checkpoint and train the failed step again
(its batch is still in the object store). Restarts back off and are capped (`fault`).

The controller holds no model. Batches go to the train ranks once, through Ray's object store.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from miles.core.components import Kind
from miles.core.config import RunConfig
from miles.core.factory import build_component
from miles.core.plugins import get_plugin_manager
from miles.core.rundir import atomic_checkpoint, latest_valid_checkpoint, prune_checkpoints
from miles.core.runtime.placement import Placement, quantizes, start_ray
from miles.core.telemetry import carrier, span
from miles.core.types import RunInfo

log = structlog.get_logger(__name__)


class WeightSyncError(RuntimeError):
    pass


class TrainGroupFailedError(RuntimeError):
    """The train group died more often than fault.max_train_restarts allows."""


class _TrainerDied(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause


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
        if resume:
            self.resume_from = latest_valid_checkpoint(run_dir)
            if self.resume_from is None:
                raise FileNotFoundError(
                    f"--resume: no complete checkpoint under {run_dir / 'checkpoints'}"
                )
            # Steps after the checkpoint run again: their old records go (before sinks open).
            for name in ("metrics.jsonl", "samples.jsonl"):
                _drop_rows_after(run_dir / name, self.resume_from[0])
        self.sinks: list[tuple[str, Any]] = []  # (where the config names it, the sink)
        for i, ref in enumerate(config.telemetry.sinks):
            label = f"telemetry.sinks[{i}] ({ref.name})"
            try:
                self.sinks.append((label, build_component(Kind.METRIC_SINK, ref, str(run_dir))))
            except Exception as exc:  # e.g. a tracking server that is down: run without it
                log.error(
                    "metric sink failed to start; running without it",
                    sink=label,
                    error=f"{type(exc).__name__}: {exc}",
                )
        self.version = 0  # of the weights on the engines
        self.synced_through = -1  # the engines hold the weights made by this step
        self.train_restarts = 0
        self.colocated = config.placement == "colocated"

    # ── set-up ───────────────────────────────────────────────────────────────────────────────────

    def _start(self) -> None:
        import ray

        start_ray(self.config, self.ray_address)
        self.placement = Placement.create(self.config, str(self.run_dir))
        self.trainers, self.manager = self.placement.trainers, self.placement.manager
        self._make_plan()
        log.info(
            "actors ready",
            trainers=len(self.trainers),
            engines=self.config.rollout.engines,
            placement=self.config.placement,
            sync_bytes=self.plan.num_bytes,
        )
        if self.colocated:
            ray.get(self.manager.release_memory.remote())  # the trainer goes first (warm-start)

    def _make_plan(self) -> None:
        bucket = self.config.rollout.sync_bucket_mb * 2**20
        self.plan = self._train_all("sync_plan", bucket)

    def _train_all(self, method: str, *args: Any) -> Any:
        """Calls `method` on every train rank; rank 0's answer. A dead rank: _TrainerDied."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        try:
            return ray.get([getattr(t, method).remote(*args) for t in self.trainers])[0]
        except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
            raise _TrainerDied(exc) from exc

    # ── weights ──────────────────────────────────────────────────────────────────────────────────

    def sync_weights(self, step: int, *, new_version: bool = True) -> dict[str, float]:
        """Sends the trainer's weights to every alive engine, as a new version (after training)
        or again as the current one (to bring restarted engines in). Engines that die during
        the sync are restarted and the sync tried again."""
        import ray

        t0 = time.perf_counter()
        version = self.version + 1 if new_version else self.version
        synced_through = step if new_version else self.synced_through
        with span("miles.weight_sync", step=step, version=version):
            for attempt in range(self.config.fault.max_engine_restarts + 1):
                try:
                    sent = self._sync_once(version, finish_batches=new_version)
                    break
                except _TrainerDied:
                    raise
                except Exception as exc:
                    log.warning("weight sync failed; retrying", attempt=attempt, error=repr(exc))
                    ray.get(self.manager.sync_failed.remote())
            else:
                raise WeightSyncError(f"weight sync to version {version} failed repeatedly")
            self.version, self.synced_through = version, synced_through
            if self.config.rollout.verify_weights:
                self.verify_weights()
            ray.get(self.manager.end_update.remote(version, synced_through))
        metrics = {
            "weights/version": float(self.version),
            "weights/sync_bytes": float(sent),
            "perf/sync_s": time.perf_counter() - t0,
        }
        self.plugins.call_lifecycle(
            "miles_after_weight_sync",
            run=self.info,
            step=step,
            version=self.version,
            metrics=metrics,
        )
        return metrics

    def _sync_once(self, version: int, *, finish_batches: bool) -> int:
        import ray

        rebuild = ray.get(self.manager.begin_update.remote(finish_batches))
        trace = carrier()
        if self.placement.colocated:
            engines = ray.get(self.manager.alive_handles.remote())
            return int(self._train_all("send_weights_ipc", self.plan, version, engines, trace))
        if rebuild:  # every member joins the new group at once
            host, port = ray.get(self.trainers[0].sync_address.remote())
            world = ray.get(self.manager.sync_world.remote())
            engines_joined = self.manager.init_sync.remote(host, port)
            self._train_all("init_sync", host, port, world)
            ray.get(engines_joined)
        receive = self.manager.receive_weights.remote(self.plan, version, trace)
        sent = self._train_all("send_weights", self.plan, version, trace)
        ray.get(receive)
        return int(sent)

    def verify_weights(self) -> None:
        """Engines must hold exactly the trainer's weights, at the current version."""
        import ray

        expected = self._train_all("checksum", self.placement.engine_dtype)  # collective
        engines, versions = ray.get(
            [self.manager.checksums.remote(), self.manager.weight_versions.remote()]
        )
        bad = [i for i, c in enumerate(engines) if c != expected]
        if bad or any(v != self.version for v in versions):
            raise WeightSyncError(
                f"weight sync verification failed at version {self.version}: engines {bad} hold "
                f"other weights (versions {versions}); the trainer's checksum is {expected[:16]}"
            )

    # ── faults ───────────────────────────────────────────────────────────────────────────────────

    def _restart_train_group(self, error: _TrainerDied) -> None:
        """Replaces every train rank and loads the latest valid checkpoint into the new group."""
        import ray

        fault = self.config.fault
        if self.train_restarts >= fault.max_train_restarts:
            raise TrainGroupFailedError(
                f"a train rank died and the train group was already restarted "
                f"{self.train_restarts} times (fault.max_train_restarts="
                f"{fault.max_train_restarts}); last error: {error}"
            ) from error.cause
        delay = min(fault.backoff_s * 2**self.train_restarts, fault.backoff_max_s)
        self.train_restarts += 1
        log.warning(
            "a train rank died; restarting the train group",
            restart=self.train_restarts,
            in_s=delay,
            error=str(error),
        )
        for trainer in self.trainers:
            with contextlib.suppress(Exception):
                ray.kill(trainer, no_restart=True)
        time.sleep(delay)
        self.trainers = self.placement.train_launcher.launch()
        self.placement.trainers = self.trainers
        found = latest_valid_checkpoint(self.run_dir)
        if found is None:
            log.warning("no checkpoint yet: the new train group starts from model.path")
        else:
            self._train_all("load", str(found[1] / "train"))
            log.info("train group restored", checkpoint=str(found[1]))
        self._make_plan()
        ray.get(self.manager.reset_sync_group.remote())  # its rank 0 is gone
        restored_step = found[0] if found else -1
        if restored_step < self.synced_through:
            # The engines run weights the new group no longer has: send the restored ones, as a
            # new version, so samples made from the lost updates count as stale.
            self._sync_after_train(restored_step)

    def _retrying_trainers(self, what: str, fn: Any) -> Any:
        """Runs `fn`; if a train rank dies in it, restarts the group and runs it again."""
        while True:
            try:
                return fn()
            except _TrainerDied as exc:
                log.warning(f"train group lost during {what}")
                error = exc
                while True:  # the restart itself may lose a rank again
                    try:
                        self._restart_train_group(error)
                        break
                    except _TrainerDied as again:
                        error = again

    def _wait_for_batch(self, ref: Any) -> None:
        """Waits for a rollout batch; meanwhile, brings in engines restarted while no engine
        was left to generate (a weight sync re-sends the current version)."""
        import ray

        while not ray.wait([ref], timeout=1.0)[0]:
            if ray.get(self.manager.needs_recovery.remote()):
                log.info("every engine was restarted; re-sending the current weights")
                self._retrying_trainers(
                    "engine recovery",
                    lambda: self.sync_weights(self.synced_through, new_version=False),
                )

    # ── stages ───────────────────────────────────────────────────────────────────────────────────

    def warmstart(self) -> None:
        """The optional SFT stage, through the same train backend."""
        import ray

        ws = self.config.warmstart
        if not ws.steps:
            return
        log.info("warm-start (SFT)", steps=ws.steps, batch_size=ws.batch_size)
        for i in range(ws.steps):
            with span("miles.warmstart", step=i):
                batch = ray.get(self.manager.sft_batch.remote(ws.batch_size))
                metrics = self._train_all("sft", ray.put(batch), i, carrier())
            if i == 0 or (i + 1) % 10 == 0 or i + 1 == ws.steps:
                log.info("warm-start step", step=i + 1, loss=round(metrics["train/loss"], 4))

    def evaluate(self, step: int) -> dict[str, float]:
        import ray

        if not self.config.eval.data:
            return {}
        metrics = dict(ray.get(self.manager.evaluate.remote(step, carrier())))
        log.info("eval", step=step, **{k: round(v, 4) for k, v in metrics.items()})
        return metrics

    def checkpoint(self, step: int) -> None:
        import ray

        cfg = self.config.checkpoint
        with span("miles.checkpoint", step=step), atomic_checkpoint(self.run_dir, step) as tmp:
            self._train_all("save", str(tmp / "train"), carrier())
            state = {
                "step": step,
                "weight_version": self.version,
                "rollout": ray.get(self.manager.get_state.remote()),
            }
            (tmp / "state.json").write_text(json.dumps(state) + "\n")
        prune_checkpoints(self.run_dir, cfg.keep_last, cfg.keep_every)
        path = str(self.run_dir / "checkpoints" / f"step_{step}")
        self.plugins.call_lifecycle("miles_after_checkpoint", run=self.info, step=step, path=path)

    def _restore(self) -> int:
        """Loads the newest valid checkpoint; returns the first step still to run."""
        import ray

        assert self.resume_from is not None
        step, path = self.resume_from
        state = json.loads((path / "state.json").read_text())
        self._train_all("load", str(path / "train"))
        ray.get(self.manager.set_state.remote(state["rollout"]))
        self.version = int(state["weight_version"]) - 1
        self._sync_after_train(step)  # engines hold the base model: bring them to the checkpoint
        log.info("resumed", checkpoint=str(path), next_step=step + 1)
        return step + 1

    # ── the loop ─────────────────────────────────────────────────────────────────────────────────

    def run(self) -> RunResult:
        import ray

        cfg = self.config
        self.plugins.call_lifecycle("miles_on_run_start", run=self.info)
        status, error, final, step = "failed", None, {}, -1
        try:
            with span("miles.run", run_id=self.info.run_id, name=cfg.name):
                with span("miles.setup"):
                    self._start()
                start = self._restore() if self.resume else 0
                if start == 0:
                    # A quantizing precision: engines loaded model.path as it is on disk, and
                    # must get the format's weights before they generate.
                    quantized = quantizes(build_component(Kind.PRECISION, cfg.precision))
                    if cfg.rollout.verify_weights and not (self.colocated or quantized):
                        self.verify_weights()  # both sides loaded model.path: they must agree
                    self.warmstart()
                    self._sync_after_train(-1, new_version=bool(cfg.warmstart.steps) or quantized)
                ray.get(self.manager.start.remote(start, self.version, carrier()))
                progress = _Progress(cfg.steps, start, enabled=cfg.telemetry.progress)
                for step in range(start, cfg.steps):
                    final = self.one_step(step)
                    progress.update(final)
                    if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                        self._retrying_trainers("checkpoint", lambda s=step: self.checkpoint(s))
                progress.close()
                if (
                    cfg.steps
                    and cfg.checkpoint.at_end
                    and not (cfg.checkpoint.every and cfg.steps % cfg.checkpoint.every == 0)
                ):
                    self._retrying_trainers("checkpoint", lambda: self.checkpoint(cfg.steps - 1))
                end_eval = self.evaluate(cfg.steps)
                if end_eval:
                    final = {**final, **end_eval}
                    self._log_metrics(cfg.steps, end_eval)
            status = "completed"
            return RunResult(self.run_dir, cfg.steps, final)
        except KeyboardInterrupt:
            status = "interrupted"
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self.plugins.call_lifecycle(
                "miles_on_run_end", run=self.info, status=status, error=error
            )
            for name, sink in self.sinks:
                try:
                    sink.close()
                except Exception as exc:  # metrics already logged stay logged
                    log.error("metric sink failed to close", sink=name, error=repr(exc))
            if ray.is_initialized():
                self._flush_actor_traces()

    def _sync_after_train(self, step: int, *, new_version: bool = True) -> dict[str, float]:
        """Weights to the engines; colocated, the trainer then hands the GPU back to them."""
        import ray

        if self.colocated:
            ray.get(self.manager.resume_memory.remote())
        metrics = self.sync_weights(step, new_version=new_version) if new_version else {}
        if self.colocated:
            self._train_all("sleep")
            ray.get(self.manager.open.remote())
        return metrics

    def one_step(self, step: int) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        with span("miles.step", step=step, run_id=self.info.run_id):
            # The batch goes from the rollout manager to the train ranks through the object store;
            # the controller only reads the small metrics dict.
            batch_ref, metrics_ref = self.manager.take.options(num_returns=2).remote(
                step, carrier()
            )
            self._wait_for_batch(metrics_ref)
            metrics: dict[str, float] = dict(ray.get(metrics_ref))
            metrics["perf/rollout_wait_s"] = time.perf_counter() - t0
            if self._wants("miles_after_rollout"):
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
                    ray.get(self.manager.release_memory.remote())
                    self._train_all("wake")
                if metrics["rollout/kept_samples"]:
                    metrics.update(self._train_all("train", batch_ref, step, carrier()))
                metrics["perf/train_s"] = time.perf_counter() - t1
                metrics.update(self._sync_after_train(step))

            self._retrying_trainers(f"step {step}", train_and_sync)
            self.plugins.call_lifecycle(
                "miles_after_train_step", run=self.info, step=step, metrics=metrics
            )
            if self.config.eval.every and (step + 1) % self.config.eval.every == 0:
                metrics.update(self.evaluate(step))
        metrics["perf/step_s"] = time.perf_counter() - t0
        metrics["perf/tokens_per_s"] = metrics["rollout/tokens"] / metrics["perf/step_s"]
        metrics["perf/trainer_idle_frac"] = 1.0 - metrics["perf/train_s"] / metrics["perf/step_s"]
        metrics["fault/train_restarts"] = float(self.train_restarts)
        self._log_metrics(step, metrics)
        return metrics

    def _wants(self, hook: str) -> bool:
        return bool(getattr(self.plugins.pm.hook, hook).get_hookimpls())

    def _log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for entry in list(self.sinks):
            name, sink = entry
            try:
                sink.log(step, metrics)
            except Exception as exc:  # a broken sink is switched off; the run goes on
                log.error(
                    "metric sink failed; switching it off",
                    sink=name,
                    error=f"{type(exc).__name__}: {exc}",
                )
                self.sinks.remove(entry)
                with contextlib.suppress(Exception):
                    sink.close()

    def _flush_actor_traces(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # best effort at shutdown
            ray.get(
                [t.flush.remote() for t in self.trainers] + [self.manager.flush.remote()],
                timeout=30,
            )


def _drop_rows_after(path: Path, step: int) -> None:
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


class _Progress:
    """A progress bar with step, reward, step time and ETA."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            initial=start,
            desc="RL steps",
            unit="step",
            disable=not enabled or total == 0,
            dynamic_ncols=True,
            mininterval=0 if os.environ.get("CI") else 0.1,
        )

    def update(self, metrics: dict[str, float]) -> None:
        self.bar.set_postfix(
            reward=f"{metrics.get('rollout/reward_mean', 0.0):.3f}",
            step_s=f"{metrics.get('perf/step_s', 0.0):.2f}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
