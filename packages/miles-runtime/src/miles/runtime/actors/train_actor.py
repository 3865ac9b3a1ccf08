"""The Ray actor around one rank of a train backend (any `TrainBackend`).

Every rank receives the same batch object (one `ray.put`) and runs every call, because FSDP-style
backends need all ranks in each collective; rank 0 alone talks to the rollout engines. The actor
builds the run's precision and algorithm components once, hands the backend a `TrainSetup`, and
runs the algorithm's batch preparation between the backend's logprobs and its train step.

The methods the train group calls are marked `@ray.method`, so mypy checks each call made through a
`TrainHandle` against them.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, cast

import ray
import structlog
from ray.actor import ActorProxy

from miles.core.config import RunConfig
from miles.core.contracts.algorithm import Algorithm, WithEntropyBonus, WithKL, loss_weights
from miles.core.contracts.backends import F32, CriticBackend, Precision, TrainBackend, TrainSetup
from miles.core.contracts.components import Capability, Kind
from miles.core.contracts.protocols import AdvantageEstimator, PolicyLoss, TokenAdvantageEstimator
from miles.core.contracts.types import PackedBatch
from miles.core.contracts.weight_sync import SyncPlan
from miles.core.observability.telemetry import attached, span
from miles.core.registry.factory import build_component
from miles.core.registry.plugins import get_plugin_manager
from miles.runtime.cluster.process import (
    flush_traces,
    init_actor_process,
    node_address,
    reserve_port,
)

if TYPE_CHECKING:
    from miles.runtime.actors.engine_actor import EngineHandle


def needs_values(config: RunConfig) -> bool:
    """Whether the run's advantage estimator works from a critic's values (e.g. gae)."""
    spec = get_plugin_manager().get(Kind.ADVANTAGE, config.algorithm.advantage.name).spec
    return spec.has(Capability.NEEDS_VALUES)


def build_algorithm(config: RunConfig) -> Algorithm:
    """The run's advantage, loss (with KL and entropy terms), correction and value loss."""
    algo = config.algorithm
    loss: PolicyLoss = build_component(Kind.LOSS, algo.loss, path="algorithm.loss")
    kl = None
    if algo.kl.coef:
        kl = build_component(Kind.KL, algo.kl.estimator, path="algorithm.kl.estimator")
        if algo.kl.mode == "loss":
            loss = WithKL(loss, kl, algo.kl.coef)
    if algo.entropy_coef:
        loss = WithEntropyBonus(loss, algo.entropy_coef)
    correction = None
    if algo.correction is not None:
        correction = build_component(Kind.CORRECTION, algo.correction, path="algorithm.correction")
    advantage = build_component(Kind.ADVANTAGE, algo.advantage, path="algorithm.advantage")
    if needs_values(config):
        value_loss = build_component(Kind.LOSS, algo.value_loss, path="algorithm.value_loss")
        return Algorithm(
            algo,
            loss,
            token_advantage=cast(TokenAdvantageEstimator, advantage),
            value_loss=value_loss,
            kl=kl,
            correction=correction,
        )
    return Algorithm(
        algo, loss, advantage=cast(AdvantageEstimator, advantage), kl=kl, correction=correction
    )


class TrainActor:
    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        config: RunConfig,
        run_dir: str | None,
        device: str,
        num_threads: int | None,
    ) -> None:
        init_actor_process(run_dir, role=f"train{rank}")
        self.rank, self.config, self.run_dir = rank, config, run_dir
        self._sync_port: socket.socket | None = None  # held from sync_address to join_sync
        self.algorithm = build_algorithm(config)
        precision: Precision = build_component(Kind.PRECISION, config.precision, path="precision")
        setup = TrainSetup(
            model_path=config.model.path,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            device=device,
            seed=config.seed,
            precision=precision,
            quantized=get_plugin_manager()
            .get(Kind.PRECISION, config.precision.name)
            .spec.has(Capability.QUANTIZED),
            # Train-side logprobs use the rollout's sampling temperature (0 is greedy: use 1).
            temperature=config.rollout.temperature or 1.0,
            total_steps=config.steps + config.warmstart.steps,
            reference=config.algorithm.kl.coef > 0,
            critic=self.algorithm.value_loss is not None,
            routing_replay=config.moe.routing_replay,
            lora=config.lora,
            sync_timeout_s=config.fault.request_timeout_s,
            cpu_threads=num_threads,
            verify_weights=config.rollout.verify_weights,
            parallel=config.train.parallel,
        )
        self.backend: TrainBackend = build_component(
            Kind.TRAIN_BACKEND,
            config.train.backend,
            setup,
            options=config.train.options,
            path="train",
        )
        self._sft_loss: PolicyLoss | None = None

    # ── training ─────────────────────────────────────────────────────────────────────────────────

    @ray.method
    def train(self, batch: PackedBatch, step: int, trace: dict[str, str]) -> dict[str, float]:
        """Old and reference logprobs, advantages and loss weights (every rank computes the
        same), then one optimizer step with the RL loss (and one for the critic). `step` is the
        loop's index; spans and profiles name the step by its number, step + 1."""
        number = step + 1
        with (
            attached(trace),
            span("miles.train_step", step=number, rank=self.rank),
            self._profiled(number),
        ):
            with span("miles.logprobs", step=number, rank=self.rank):
                out = self.backend.logprobs(batch)
            critic = cast(CriticBackend, self.backend)

            def values() -> F32:
                with span("miles.values", step=number, rank=self.rank):
                    return critic.values(batch)

            metrics = self.algorithm.prepare(batch, out, values)
            metrics.update(self.backend.train_step(batch, self.algorithm.loss))
            if self.algorithm.value_loss is not None:
                metrics.update(critic.train_value_step(batch, self.algorithm.value_loss))
            return metrics

    @contextlib.contextmanager
    def _profiled(self, step: int) -> Iterator[None]:
        """`telemetry.profile_steps`: this step's train call under the backend's profiler."""
        profiled = getattr(self.backend, "profiled", None)
        if step not in self.config.telemetry.profile_steps or self.run_dir is None:
            yield
        elif profiled is None:
            structlog.get_logger(__name__).warning(
                "telemetry.profile_steps: this train backend has no profiler", step=step
            )
            yield
        else:
            out = Path(self.run_dir) / "profiles"
            out.mkdir(exist_ok=True)
            with profiled(str(out / f"train{self.rank}-step{step}")):
                yield

    @ray.method
    def warmstart_step(
        self, batch: PackedBatch, step: int, trace: dict[str, str]
    ) -> dict[str, float]:
        """One supervised step of the warm-start stage (`warmstart.loss`), token mean."""
        if self._sft_loss is None:
            ref = self.config.warmstart.loss
            self._sft_loss = build_component(Kind.LOSS, ref, path="warmstart.loss")
        batch.loss_weights = loss_weights(batch, "token_mean")
        with attached(trace), span("miles.sft_step", step=step, rank=self.rank):
            return dict(self.backend.train_step(batch, self._sft_loss))

    # ── weights ──────────────────────────────────────────────────────────────────────────────────

    @ray.method
    def sync_plan(self, bucket_bytes: int) -> SyncPlan:
        """Names, shapes and dtypes of what engines receive (collective: all ranks call it)."""
        return self.backend.weight_sync_plan(bucket_bytes)

    @ray.method
    def sync_address(self) -> tuple[str, int]:
        """Where the sync group meets: this node's address (never localhost: engines may be on
        other nodes) and a port held until rank 0's store listens on it, so concurrent runs on
        one node never pick the same one."""
        self._release_sync_port()
        self._sync_port = reserve_port()
        return node_address(), int(self._sync_port.getsockname()[1])

    @ray.method
    def join_sync(self, host: str, port: int, world_size: int) -> None:
        try:
            self.backend.join_weight_sync(host, port, world_size)
        finally:
            self._release_sync_port()

    def _release_sync_port(self) -> None:
        held, self._sync_port = self._sync_port, None
        if held is not None:
            held.close()

    @ray.method
    def leave_sync(self) -> None:
        self.backend.leave_weight_sync()

    @ray.method
    def send_weights(self, plan: SyncPlan, version: int, trace: dict[str, str]) -> int:
        """Streams weights to the engines (collective over ranks; rank 0 broadcasts)."""
        with attached(trace), span("miles.weight_sync.send", version=version, rank=self.rank):
            return self.backend.send_weights(plan)

    @ray.method
    def send_weights_in_place(
        self,
        plan: SyncPlan,
        version: int,
        engines: list[EngineHandle | None],
        trace: dict[str, str],
    ) -> int:
        """Colocated: rank r hands each bucket to engine r on its own GPU, one round trip per
        bucket (collective over ranks: every rank materialises every full tensor)."""
        engine = engines[self.rank] if self.rank < len(engines) else None

        def deliver(index: int, handle: object) -> None:  # handle: the backend's, opaque here
            assert engine is not None
            ray.get(engine.load_bucket.remote(plan, index, handle))

        with attached(trace), span("miles.weight_sync.ipc", version=version, rank=self.rank):
            # A rank without an engine (down, or fewer engines than ranks) only helps gather.
            sent = self.backend.send_weights_in_place(plan, deliver if engine else None)
            if engine is not None:
                ray.get(engine.set_weight_version.remote(version))
            return sent

    @ray.method
    def checksum(self, dtype: str | None = None) -> str:
        """Hash of the weights as engines holding `dtype` should hold them (collective; rank
        0's is used)."""
        return self.backend.weights_checksum(dtype)

    @ray.method
    def sleep(self) -> None:
        """Colocated: weights and optimizer state to host memory while the engines generate."""
        self.backend.sleep()

    @ray.method
    def wake(self) -> None:
        self.backend.wake()

    # ── checkpoints ──────────────────────────────────────────────────────────────────────────────

    @ray.method
    def save(self, path: str, trace: dict[str, str]) -> None:
        with attached(trace), span("miles.checkpoint.train", rank=self.rank):
            self.backend.save(path)

    @ray.method
    def load(self, path: str) -> None:
        self.backend.load(path)

    @ray.method
    def flush(self) -> None:
        flush_traces()


# What `ray.remote(TrainActor)...remote(...)` returns: the handle the train group calls a rank by.
TrainHandle: TypeAlias = "ActorProxy[TrainActor]"
