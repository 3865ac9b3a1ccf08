"""The Ray actor around one rollout engine (any `RolloutEngine` backend)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from miles.core.components import Kind
from miles.core.factory import build_component
from miles.core.runtime.process import init_actor_process
from miles.core.telemetry import attached, span
from miles.core.types import GenerateRequest, GenerateResult
from miles.core.weight_sync import SyncGroup, SyncPlan


class EngineActor:
    def __init__(
        self,
        *,
        index: int,
        backend: str,
        options: dict[str, Any],
        model_path: str,
        device: str,
        seed: int,
        run_dir: str | None,
        num_threads: int | None,
    ) -> None:
        init_actor_process(run_dir, role=f"engine{index}", num_threads=num_threads)
        self.index = index
        self.engine = build_component(
            Kind.ROLLOUT_BACKEND,
            backend,
            model_path,
            options=options,
            path="rollout",
            device=device,
            seed=seed + 7919 * index,
        )
        self.device = device
        self._sync: SyncGroup | None = None

    def generate(
        self, requests: list[GenerateRequest], trace_carrier: dict[str, str]
    ) -> Iterator[GenerateResult]:
        """Streams each result as it finishes (call with ``num_returns="streaming"``)."""
        with (
            attached(trace_carrier),
            span("miles.generate", engine=self.index, requests=len(requests)),
        ):
            # A plain loop, not `yield from`: Ray drives this generator with send(), which must
            # not reach the engine's own generator.
            for result in self.engine.generate(requests):  # noqa: UP028
                yield result

    def init_sync(self, host: str, port: int, world_size: int, rank: int) -> None:
        self._sync = SyncGroup(host, port, world_size, rank, device=self.device)

    def receive_weights(self, plan: SyncPlan, version: int, trace_carrier: dict[str, str]) -> None:
        assert self._sync is not None, "init_sync first"
        with (
            attached(trace_carrier),
            span("miles.weight_sync.receive", engine=self.index, version=version),
        ):
            self.engine.load_weights(self._sync.receive(plan), version)

    def checksum(self) -> str:
        return str(self.engine.weights_checksum())

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def health(self) -> dict[str, Any]:
        return dict(self.engine.health())

    def tokenizer_path(self) -> str:
        return str(getattr(self.engine, "model_path", ""))
