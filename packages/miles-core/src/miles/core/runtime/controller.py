"""The controller: starts Ray and the actors, then runs the RL loop (sync mode).

    rollout manager ─▶ (advantages, loss weights) ─▶ train group ─▶ weight sync ─▶ engines

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
from miles.core.rundir import atomic_checkpoint, list_checkpoints, prune_checkpoints
from miles.core.runtime.placement import Placement, start_ray
from miles.core.telemetry import carrier, span
from miles.core.types import RunInfo

log = structlog.get_logger(__name__)


class WeightSyncError(RuntimeError):
    pass


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
        self.sinks = [
            build_component(Kind.METRIC_SINK, s, str(run_dir)) for s in config.telemetry.sinks
        ]
        self.version = 0

    # ── set-up ───────────────────────────────────────────────────────────────────────────────────

    def _start(self) -> None:
        import ray

        start_ray(self.config, self.ray_address)
        self.placement = Placement.create(self.config, str(self.run_dir))
        self.trainers, self.manager = self.placement.trainers, self.placement.manager
        bucket = self.config.rollout.sync_bucket_mb * 2**20
        self.plan = ray.get([t.sync_plan.remote(bucket) for t in self.trainers])[0]
        host, port = ray.get(self.trainers[0].sync_address.remote())
        world = self.config.rollout.engines + 1
        ray.get(
            [
                self.manager.init_sync.remote(host, port),
                *[t.init_sync.remote(host, port, world) for t in self.trainers],
            ]
        )
        log.info(
            "actors ready",
            trainers=len(self.trainers),
            engines=self.config.rollout.engines,
            sync_bytes=self.plan.num_bytes,
        )

    def _train_all(self, method: str, *args: Any) -> Any:
        import ray

        return ray.get([getattr(t, method).remote(*args) for t in self.trainers])[0]

    # ── weights ──────────────────────────────────────────────────────────────────────────────────

    def sync_weights(self, step: int) -> dict[str, float]:
        import ray

        self.version += 1
        t0 = time.perf_counter()
        with span("miles.weight_sync", step=step, version=self.version):
            trace = carrier()
            results = ray.get(
                [
                    self.manager.receive_weights.remote(self.plan, self.version, trace),
                    *[t.send_weights.remote(self.plan, self.version, trace) for t in self.trainers],
                ]
            )
            metrics = {
                "weights/version": float(self.version),
                "weights/sync_bytes": float(results[1]),
            }
            if self.config.rollout.verify_weights:
                self.verify_weights()
        metrics["perf/sync_s"] = time.perf_counter() - t0
        self.plugins.call_lifecycle(
            "miles_after_weight_sync",
            run=self.info,
            step=step,
            version=self.version,
            metrics=metrics,
        )
        return metrics

    def verify_weights(self) -> None:
        """Engines must hold exactly the trainer's weights, at the current version."""
        import ray

        trainer_refs = [t.checksum.remote() for t in self.trainers]  # collective over ranks
        engine_refs = [self.manager.checksums.remote(), self.manager.weight_versions.remote()]
        expected, engines, versions = ray.get([trainer_refs[0], *engine_refs])
        ray.get(trainer_refs[1:])
        bad = [i for i, c in enumerate(engines) if c != expected]
        if bad or any(v != self.version for v in versions):
            raise WeightSyncError(
                f"weight sync verification failed at version {self.version}: engines {bad} hold "
                f"other weights (versions {versions}); the trainer's checksum is {expected[:16]}"
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

        with span("miles.checkpoint", step=step), atomic_checkpoint(self.run_dir, step) as tmp:
            ray.get([t.save.remote(str(tmp / "train"), carrier()) for t in self.trainers])
            state = {
                "step": step,
                "weight_version": self.version,
                "rollout": ray.get(self.manager.get_state.remote()),
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        prune_checkpoints(self.run_dir, self.config.checkpoint.keep)
        path = str(self.run_dir / "checkpoints" / f"step_{step}")
        self.plugins.call_lifecycle("miles_after_checkpoint", run=self.info, step=step, path=path)

    def _restore(self) -> int:
        """Loads the newest checkpoint; returns the first step still to run."""
        import ray

        found = list_checkpoints(self.run_dir)
        if not found:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.run_dir / 'checkpoints'}")
        step, path = found[-1]
        state = json.loads((path / "state.json").read_text())
        ray.get([t.load.remote(str(path / "train")) for t in self.trainers])
        ray.get(self.manager.set_state.remote(state["rollout"]))
        self.version = int(state["weight_version"]) - 1
        self.sync_weights(step)  # engines start from the base model; bring them to the checkpoint
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
                if cfg.rollout.verify_weights:
                    self.verify_weights()  # both sides loaded model.path: they must agree already
                start = self._restore() if self.resume else 0
                if start == 0:
                    self.warmstart()
                    if cfg.warmstart.steps:
                        self.sync_weights(-1)
                progress = _Progress(cfg.steps, start, enabled=cfg.telemetry.progress)
                for step in range(start, cfg.steps):
                    final = self.one_step(step)
                    progress.update(final)
                    if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
                        self.checkpoint(step)
                progress.close()
                if (
                    cfg.steps
                    and cfg.checkpoint.at_end
                    and not (cfg.checkpoint.every and cfg.steps % cfg.checkpoint.every == 0)
                ):
                    self.checkpoint(cfg.steps - 1)
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
            for sink in self.sinks:
                sink.close()
            if ray.is_initialized():
                self._flush_actor_traces()

    def one_step(self, step: int) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        with span("miles.step", step=step, run_id=self.info.run_id):
            # The batch goes from the rollout manager to the train ranks through the object store;
            # the controller only reads the small metrics dict.
            batch_ref, metrics_ref = self.manager.rollout.options(num_returns=2).remote(
                step, carrier()
            )
            metrics: dict[str, float] = dict(ray.get(metrics_ref))
            metrics["perf/rollout_s"] = time.perf_counter() - t0
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
            if metrics["rollout/kept_samples"]:
                metrics.update(self._train_all("train", batch_ref, step, carrier()))
            metrics["perf/train_s"] = time.perf_counter() - t1
            self.plugins.call_lifecycle(
                "miles_after_train_step", run=self.info, step=step, metrics=metrics
            )
            metrics.update(self.sync_weights(step))
            if self.config.eval.every and (step + 1) % self.config.eval.every == 0:
                metrics.update(self.evaluate(step))
        metrics["perf/step_s"] = time.perf_counter() - t0
        metrics["perf/tokens_per_s"] = metrics["rollout/tokens"] / metrics["perf/step_s"]
        self._log_metrics(step, metrics)
        return metrics

    def _wants(self, hook: str) -> bool:
        return bool(getattr(self.plugins.pm.hook, hook).get_hookimpls())

    def _log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for sink in list(self.sinks):
            try:
                sink.log(step, metrics)
            except Exception as exc:  # a broken sink is switched off; the run goes on
                log.error(
                    "metric sink failed; switching it off",
                    sink=type(sink).__name__,
                    error=repr(exc),
                )
                self.sinks.remove(sink)

    def _flush_actor_traces(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # best effort at shutdown
            ray.get([t.flush.remote() for t in self.trainers], timeout=30)


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
