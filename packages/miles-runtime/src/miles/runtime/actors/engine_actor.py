"""The Ray actor around one rollout engine (any `RolloutEngine` backend).

The actor is threaded, with two pools of threads (Ray concurrency groups): `generate` streams run
in their own wide pool, and `pause`, `health` and weight loading in the default one, so a control
call answers at once however many streams are running. The engine's own lock keeps model steps and
weight loads apart. The actor builds the run's precision once and hands the backend a
`RolloutSetup`; what arrives in a weight sync, and how, is the backend's business.

The methods other actors call are marked `@ray.method`, so mypy checks each call made through an
`EngineHandle` against them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeAlias

import ray
from ray.actor import ActorClass, ActorProxy

from miles.core.config import ReplayMode, RunConfig
from miles.core.contracts.backends import Precision, RolloutEngine, RolloutSetup
from miles.core.contracts.components import Kind
from miles.core.contracts.types import GenerateRequest, GenerateResult
from miles.core.contracts.weight_sync import SyncPlan
from miles.core.observability.telemetry import attached, span
from miles.core.registry.factory import build_component
from miles.runtime.cluster.process import flush_traces, init_actor_process, node_id

# pause, health and a weight load at once, with room to spare.
CONTROL_CONCURRENCY = 8
# Streams at once: agent and multi-turn rollouts send one request per call, so each request in
# flight is a stream, and the engine (the paged path, a server behind HTTP) batches the requests
# of the streams running together. 8 here capped an agent step's batch at 8 requests.
GENERATE_CONCURRENCY = 256
CONCURRENCY_GROUPS = {"generate": GENERATE_CONCURRENCY}
# Engines draw different samples: each seeds its sampler from the run's seed and its index.
_SEED_STRIDE = 7919


class EngineActor:
    def __init__(
        self,
        *,
        index: int,
        config: RunConfig,
        record_routing: ReplayMode,
        device: str,
        run_dir: str | None,
        num_threads: int | None,
    ) -> None:
        init_actor_process(run_dir, role=f"engine{index}")
        self.index = index
        precision: Precision = build_component(Kind.PRECISION, config.precision, path="precision")
        lora = config.lora
        setup = RolloutSetup(
            model_path=config.model.path,
            device=device,
            seed=config.seed + _SEED_STRIDE * index,
            precision=precision,
            record_routing=record_routing,
            lora=lora if lora is not None and lora.sync == "adapters" else None,
            sync_timeout_s=config.fault.request_timeout_s,
            cpu_threads=num_threads,
            index=index,
            run_dir=run_dir,
        )
        self.engine: RolloutEngine = build_component(
            Kind.ROLLOUT_BACKEND,
            config.rollout.backend,
            setup,
            options=config.rollout.options,
            path="rollout",
        )

    @ray.method(concurrency_group="generate")
    def generate(
        self, requests: list[GenerateRequest], trace_carrier: dict[str, str]
    ) -> Iterator[list[GenerateResult]]:
        """Streams the results as they finish, those finished together in one item (call with
        ``num_returns="streaming"``)."""
        with (
            attached(trace_carrier),
            span("miles.generate", engine=self.index, requests=len(requests)),
        ):
            if self.engine.health().get("paused"):
                # Paused for a weight update before this call started: hand every request back
                # untouched, so the dispatcher requeues it, rather than raising.
                version = self.engine.weight_version
                yield [GenerateResult(r.request_id, [], [], "abort", version) for r in requests]
                return
            # A plain loop, not `yield from`: Ray drives this generator with send(), which must
            # not reach the engine's own generator.
            for finished in self.engine.generate(requests):  # noqa: UP028
                yield finished

    @ray.method
    def pause(self) -> None:
        """Unfinished requests come back now as "abort" results with their tokens so far."""
        self.engine.pause()

    @ray.method
    def resume(self) -> None:
        self.engine.resume()

    @ray.method
    def release_memory(self) -> None:
        self.engine.release_memory()

    @ray.method
    def resume_memory(self) -> None:
        self.engine.resume_memory()

    @ray.method
    def join_weight_sync(self, host: str, port: int, world_size: int, rank: int) -> None:
        self.engine.join_weight_sync(host, port, world_size, rank)

    @ray.method
    def leave_weight_sync(self) -> None:
        self.engine.leave_weight_sync()

    @ray.method
    def receive_weights(self, plan: SyncPlan, version: int, trace_carrier: dict[str, str]) -> None:
        with (
            attached(trace_carrier),
            span("miles.weight_sync.receive", engine=self.index, version=version),
        ):
            self.engine.receive_weights(plan, version)

    @ray.method
    def load_bucket(self, plan: SyncPlan, index: int, handle: object) -> None:
        """One bucket shared by a colocated trainer (`handle`: the train backend's, e.g. a CUDA
        IPC handle, opaque here); copied in before return."""
        self.engine.load_bucket(plan, index, handle)

    @ray.method
    def set_weight_version(self, version: int) -> None:
        self.engine.set_weight_version(version)

    @ray.method
    def checksum(self) -> str:
        return self.engine.weights_checksum()

    @ray.method
    def weight_version(self) -> int:
        return self.engine.weight_version

    @ray.method
    def health(self) -> dict[str, Any]:
        """The engine's health, and the Ray node it runs on."""
        return {**self.engine.health(), "node_id": node_id()}

    @ray.method
    def flush(self) -> None:
        """Sends this process's buffered spans (OTLP batches) on, e.g. before the run ends."""
        flush_traces()

    @ray.method
    def get_rng_state(self) -> str:
        return self.engine.get_rng_state()

    @ray.method
    def set_rng_state(self, state: str) -> None:
        self.engine.set_rng_state(state)


def engine_actor_class() -> ActorClass[EngineActor]:
    """EngineActor as a Ray actor class with its `generate` pool: concurrency groups are a class
    option (`.options()` refuses them), which Ray's typing of `ray.remote` leaves out."""
    options: dict[str, Any] = {"concurrency_groups": CONCURRENCY_GROUPS}
    actor_class: ActorClass[EngineActor] = ray.remote(**options)(EngineActor)
    return actor_class


# What `engine_actor_class()...remote(...)` returns: the handle the other actors call it by.
EngineHandle: TypeAlias = "ActorProxy[EngineActor]"
