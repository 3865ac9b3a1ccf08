"""An engine's half of weight sync, for torch rollout engines.

Buckets arrive over the broadcast group or in place (colocated). A quantized precision's format
is decoded on the way in when the engine has no kernel for it (and the engine says so); with
`lora.sync: adapters` only the adapters arrive, and are applied to the base the engine holds,
which the receiver first brings into the format the trainer's frozen base is in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog
import torch

from miles.core.config import LoRAConfig
from miles.core.contracts.backends import Precision
from miles.core.contracts.weight_sync import SyncPlan
from miles.torch.models import load_causal_lm
from miles.torch.sync import ipc
from miles.torch.sync.group import SyncGroup
from miles.torch.weights import named_state

Named = Iterable[tuple[str, torch.Tensor]]


class WeightReceiver:
    """`load(named, version)` copies plain weights into the engine's model (version None:
    keep it); `apply_adapters(named, scaling, version)` sets base + adapters."""

    def __init__(
        self,
        *,
        model_path: str,
        dtype: torch.dtype,
        device: torch.device,
        load: Callable[[Named, int | None], None],
        apply_adapters: Callable[[Named, float, int | None], None],
        precision: Precision | None = None,
        lora: LoRAConfig | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.device, self.timeout_s = device, timeout_s
        self._load, self._apply = load, apply_adapters
        self.decoder = precision.rollout_decoder(dtype) if precision is not None else None
        self.adapter_scaling = lora.scaling if lora is not None else None
        self._parts: list[tuple[str, torch.Tensor]] = []  # in-place adapter buckets so far
        self._group: SyncGroup | None = None
        if self.decoder is not None:
            # No kernel for the format here: say so once, in events.jsonl.
            structlog.get_logger(__name__).info(
                "engine dequantizes synced weights", format=self.decoder.report
            )
            if self.adapter_scaling is not None:
                assert precision is not None
                # Only adapters will arrive: bring the loaded base into the format the trainer's
                # frozen base is in, once (a restarted engine does it again).
                base = precision.convert_for_rollout(_checkpoint_weights(model_path))
                self._load(self.decoder(base), None)

    @property
    def report(self) -> str | None:
        """What the engine does with the format, if anything."""
        return None if self.decoder is None else self.decoder.report

    def join(self, host: str, port: int, world_size: int, rank: int) -> None:
        self.close()
        self._group = SyncGroup(
            host, port, world_size, rank, device=str(self.device), timeout_s=self.timeout_s
        )

    def receive(self, plan: SyncPlan, version: int) -> None:
        if self._group is None:
            raise RuntimeError("weight sync: join a sync group before receiving")
        self._take(self._decoded(self._group.receive(plan)), version)

    def load_bucket(self, plan: SyncPlan, index: int, handle: Any) -> None:
        """One bucket shared by a colocated trainer: weights load now; adapters wait for the
        rest (they apply as a set, at `finish`)."""

        def load(named: Iterator[tuple[str, torch.Tensor]]) -> None:
            tensors = self._decoded(named)
            if self.adapter_scaling is None:
                self._load(tensors, None)
            else:
                self._parts += [(n, t.clone()) for n, t in tensors]

        ipc.consume(plan.buckets[index], handle, load)

    def finish(self) -> None:
        """The last in-place bucket arrived: apply the adapters collected so far."""
        if self._parts:
            parts, self._parts = self._parts, []
            self._take(parts, None)

    def _take(self, tensors: Named, version: int | None) -> None:
        if self.adapter_scaling is None:
            self._load(tensors, version)
        else:
            self._apply(tensors, self.adapter_scaling, version)

    def _decoded(self, tensors: Named) -> Named:
        return tensors if self.decoder is None else self.decoder(tensors)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None


def _checkpoint_weights(model_path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's weights in fp32, by Hugging Face name, as the trainer's master weights
    hold them (converting them gives the same bits on both sides)."""
    yield from named_state(load_causal_lm(model_path, dtype=torch.float32))
