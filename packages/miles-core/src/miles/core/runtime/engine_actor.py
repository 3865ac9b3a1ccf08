"""The Ray actor around one rollout engine (any `RolloutEngine` backend).

The actor is threaded (`max_concurrency` > 1): `pause`, `health` and weight loading answer while
a `generate` stream is running in another thread. The engine's own lock keeps model steps and
weight loads apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import structlog
import torch

from miles.core.components import Kind
from miles.core.factory import build_component
from miles.core.runtime.placement import quantizes
from miles.core.runtime.process import flush_traces, init_actor_process
from miles.core.telemetry import attached, span
from miles.core.types import GenerateRequest, GenerateResult
from miles.core.weight_sync import SyncGroup, SyncPlan

# generate, pause, health and a weight load at once, with room to spare.
MAX_CONCURRENCY = 8


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
        sync_timeout_s: float = 600.0,
        precision: Any = None,
        lora: Any = None,
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
        self.sync_timeout_s = sync_timeout_s
        # A low-precision format the engine has no kernel for: weights arrive quantized with
        # their scales and are dequantized on load (and `health` says so).
        # lora.sync: adapters: what arrives is adapters to apply on the loaded base.
        self.adapter_scaling = None
        self._adapter_parts: list[tuple[str, torch.Tensor]] = []
        if lora is not None and lora.sync == "adapters":
            self.adapter_scaling = lora.alpha / lora.rank
        self.decoder = None
        if precision is not None:
            fmt = build_component(Kind.PRECISION, precision, path="precision")
            if quantizes(fmt):
                self.decoder = fmt.rollout_decoder(getattr(torch, options.get("dtype", "float32")))
                # This engine has no kernel for the format: say so once, in events.jsonl.
                structlog.get_logger(__name__).info(
                    "engine dequantizes synced weights", engine=index, format=self.decoder.report
                )
                if self.adapter_scaling is not None:
                    # Only adapters will arrive: bring the base it loaded into the format the
                    # trainer's frozen base is in, once (a restarted engine does it again).
                    base = fmt.convert_for_rollout(_checkpoint_weights(model_path))
                    self.engine.load_weights(self.decoder(base), None)
        self._sync: SyncGroup | None = None

    def generate(
        self, requests: list[GenerateRequest], trace_carrier: dict[str, str]
    ) -> Iterator[GenerateResult]:
        """Streams each result as it finishes (call with ``num_returns="streaming"``)."""
        with (
            attached(trace_carrier),
            span("miles.generate", engine=self.index, requests=len(requests)),
        ):
            if self.engine.health().get("paused"):
                # Paused for a weight update before this call started: hand every request back
                # untouched, so the dispatcher requeues it, rather than raising.
                for r in requests:
                    yield GenerateResult(r.request_id, [], [], "abort", self.weight_version())
                return
            # A plain loop, not `yield from`: Ray drives this generator with send(), which must
            # not reach the engine's own generator.
            for result in self.engine.generate(requests):  # noqa: UP028
                yield result

    def pause(self) -> None:
        """Unfinished requests come back now as "abort" results with their tokens so far."""
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def release_memory(self) -> None:
        self.engine.release_memory()

    def resume_memory(self) -> None:
        self.engine.resume_memory()

    def init_sync(self, host: str, port: int, world_size: int, rank: int) -> None:
        if self._sync is not None:
            self._sync.close()
        self._sync = SyncGroup(
            host, port, world_size, rank, device=self.device, timeout_s=self.sync_timeout_s
        )

    def load_bucket(self, plan: SyncPlan, index: int, handle: Any) -> None:
        """One bucket shared by a colocated trainer (CUDA IPC on GPU); copied in before return."""
        from miles.core import ipc

        ipc.consume(
            plan.buckets[index],
            handle,
            lambda tensors: self._load_part(self._decoded(tensors)),
        )

    def _load_part(self, tensors: Any) -> None:
        """One IPC bucket: weights load now; adapters wait for the rest (they apply as a set)."""
        if self.adapter_scaling is None:
            self.engine.load_weights(tensors, None)
        else:
            self._adapter_parts += [(n, t.clone()) for n, t in tensors]

    def _load(self, tensors: Any, version: int | None) -> None:
        if self.adapter_scaling is None:
            self.engine.load_weights(tensors, version)
        else:
            self.engine.apply_adapters(tensors, self.adapter_scaling, version)

    def _decoded(self, tensors: Any) -> Any:
        return tensors if self.decoder is None else self.decoder(tensors)

    def set_weight_version(self, version: int) -> None:
        if self._adapter_parts:
            parts, self._adapter_parts = self._adapter_parts, []
            self._load(parts, None)
        self.engine.set_weight_version(version)

    def receive_weights(self, plan: SyncPlan, version: int, trace_carrier: dict[str, str]) -> None:
        assert self._sync is not None, "init_sync first"
        with (
            attached(trace_carrier),
            span("miles.weight_sync.receive", engine=self.index, version=version),
        ):
            self._load(self._decoded(self._sync.receive(plan)), version)

    def checksum(self) -> str:
        return str(self.engine.weights_checksum())

    def weight_version(self) -> int:
        return int(self.engine.weight_version)

    def health(self) -> dict[str, Any]:
        health = dict(self.engine.health())
        if self.decoder is not None:
            health["weights_format"] = self.decoder.report
        return health

    def flush(self) -> None:
        """Sends this process's buffered spans (OTLP batches) on, e.g. before the run ends."""
        flush_traces()

    def get_rng_state(self) -> str:
        return str(self.engine.get_rng_state())

    def set_rng_state(self, state: str) -> None:
        self.engine.set_rng_state(state)

    def tokenizer_path(self) -> str:
        return str(getattr(self.engine, "model_path", ""))


def _checkpoint_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's weights in fp32, by Hugging Face name, as the trainer's master weights
    hold them (converting them gives the same bits on both sides)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    persistent = set(model.state_dict().keys())
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n in persistent)
