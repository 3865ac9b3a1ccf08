"""MoE routing replay in torch: record the experts the rollout engine chose, make the trainer
use them.

A model family's `RouterAdapter` (miles.core.contracts.family) knows two things about an architecture: where
its routers are (one per MoE layer, in layer order) and how it turns router logits into gate
weights for a given set of experts. Every transformers router we support returns `(logits,
gate_weights, expert_indices)` for the flattened tokens of a forward; recording and replay are
forward hooks on those routers, so the model code itself is untouched.

- `RoutingRecorder` (engine side) keeps each router's indices (and weights) per forward.
- `RoutingReplay` (trainer side) swaps the router's choice for the recorded one: `ids` recomputes
  the gate weights from the live logits at the recorded experts (the router keeps its gradient),
  `ids+weights` takes the weights from the record too. A record of -1 means "no record" (padding,
  or the last token, which the engine never fed through the model): the live choice stands.
  The replay stays set for a whole micro-batch, forward and backward, so activation
  recomputation during backward routes the same way. Whether replay took hold is measured where
  it matters: a forward pre-hook on each MoE layer's experts module (the router's sibling
  `experts`) compares the indices the experts really receive with the record.

Records are `[tokens, moe_layers, top_k]` integer arrays in the smallest signed dtype that holds
every expert index (and -1).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from miles.core.config import ReplayMode
from miles.core.contracts.family import RouterAdapter
from miles.core.registry.families import family_of_config


def router_adapter(model: Any, setting: str) -> RouterAdapter | None:
    """The router adapter for a loaded model, through its family; None for a model without one.
    `setting` names what asked for it, for the error when a family cannot serve it."""
    family = family_of_config(model.config.to_dict())
    if family is None or family.router is None:
        if setting.endswith("'off'"):
            return None
        raise ValueError(
            f"{setting}: no installed model family has a router adapter for model_type "
            f"{model.config.model_type!r}"
        )
    return family.router


def index_dtype(num_experts: int) -> np.dtype[Any]:
    """The smallest signed integer dtype that holds 0..num_experts-1 and -1."""
    return np.dtype(np.min_scalar_type(-max(num_experts, 1)))


@dataclass
class _Capture:
    indices: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)


class RoutingRecorder:
    """Engine side: after each forward, `take()` gives every MoE layer's choice for its tokens."""

    def __init__(self, model: Any, adapter: RouterAdapter, with_weights: bool) -> None:
        self.with_weights = with_weights
        self._routers = adapter.routers(model)
        if not self._routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to record")
        self._capture = _Capture()
        for router in self._routers:
            router.register_forward_hook(self._hook)

    @property
    def num_layers(self) -> int:
        return len(self._routers)

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        _, weights, indices = output
        self._capture.indices.append(indices.detach())
        if self.with_weights:
            self._capture.weights.append(weights.detach().float())

    def take(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """([tokens, layers, top_k] indices, [tokens, layers, top_k] weights or None) of the
        forward that just ran; clears the capture."""
        capture, self._capture = self._capture, _Capture()
        if len(capture.indices) != self.num_layers:
            raise RuntimeError(
                f"recorded {len(capture.indices)} router calls for {self.num_layers} MoE layers"
            )
        indices = torch.stack(capture.indices, dim=1)
        weights = torch.stack(capture.weights, dim=1) if capture.weights else None
        return indices, weights


@dataclass
class ReplayStats:
    compared: int = 0  # token-layer pairs with a record
    agreed: int = 0  # ... where the live router chose the same set of experts
    replayed_tokens: int = 0  # tokens with a record
    # token-layer pairs (with a record) whose experts module received the recorded experts
    matched: int = 0


class RoutingReplay:
    """Trainer side: while `active(...)` is set, every router uses the recorded experts. With
    mode "off" it only measures how often the live router agrees with the record."""

    def __init__(self, model: Any, adapter: RouterAdapter, mode: ReplayMode) -> None:
        self.mode, self.adapter = mode, adapter
        self._routers = adapter.routers(model)
        if not self._routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to replay")
        self._layer = {id(r): i for i, r in enumerate(self._routers)}
        self._indices: torch.Tensor | None = None  # [tokens, layers, k]
        self._weights: torch.Tensor | None = None
        self.stats = ReplayStats()
        self.counting = False
        for router in self._routers:
            router.register_forward_hook(self._hook)
        experts = [_experts_of(model, router) for router in self._routers]
        # `matched` is only meaningful when every MoE layer's experts can be watched.
        self.verifies = all(e is not None for e in experts)
        self._experts_layer = {id(e): i for i, e in enumerate(experts) if e is not None}
        for module in experts:
            if module is not None:
                module.register_forward_pre_hook(self._experts_hook, with_kwargs=True)

    @property
    def num_layers(self) -> int:
        return len(self._routers)

    @contextmanager
    def active(
        self, indices: torch.Tensor | None, weights: torch.Tensor | None = None
    ) -> Iterator[None]:
        """Replays `indices` ([tokens of the forward, layers, k], -1 for none) inside."""
        self._indices, self._weights = indices, weights
        try:
            yield
        finally:
            self._indices = self._weights = None

    def _hook(self, module: Any, args: Any, output: Any) -> Any:
        if self._indices is None:
            return output
        logits, live_weights, live = output
        layer = self._layer[id(module)]
        recorded = self._indices[:, layer].to(live.device)
        if recorded.shape != live.shape:
            raise RuntimeError(
                f"routing record of shape {tuple(recorded.shape)} for a forward that routed "
                f"{tuple(live.shape)} (tokens, top_k): the record is misaligned with the batch"
            )
        has = (recorded >= 0).all(dim=-1)  # [tokens]
        if self.counting:
            same = (live.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1)
            self.stats.compared += int(has.sum())
            self.stats.agreed += int((same & has).sum())
            if layer == 0:
                self.stats.replayed_tokens += int(has.sum()) if self.mode != "off" else 0
        if self.mode == "off":
            return output
        indices = torch.where(has[:, None], recorded.to(live.dtype), live)
        if self.mode == "ids+weights" and self._weights is not None:
            recorded_w = self._weights[:, layer].to(live_weights.device, live_weights.dtype)
            weights = torch.where(has[:, None], recorded_w, live_weights)
        else:
            weights = self.adapter.gate_weights(module, logits, indices).to(live_weights.dtype)
        return logits, weights, indices

    def _experts_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Counts the recorded token-layer pairs whose experts module receives exactly the
        recorded experts: measured downstream of the router, so a replay that does not reach
        the experts (or anything rewriting indices on the way) shows up as a mismatch."""
        if self._indices is None or not self.counting or self.mode == "off":
            return
        received = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if not isinstance(received, torch.Tensor):
            return  # nothing recognisable reached the experts: no pair counts as matched
        recorded = self._indices[:, self._experts_layer[id(module)]].to(received.device)
        if recorded.shape != received.shape:
            return
        has = (recorded >= 0).all(dim=-1)
        same = received.sort(dim=-1).values == recorded.to(received.dtype).sort(dim=-1).values
        self.stats.matched += int((same.all(dim=-1) & has).sum())

    def take_stats(self) -> ReplayStats:
        stats, self.stats = self.stats, ReplayStats()
        return stats


def _experts_of(model: Any, router: Any) -> Any | None:
    """The `experts` module beside `router` in its MoE block (every supported transformers MoE
    block calls `self.experts(hidden, indices, weights)` with the router's output); None if the
    block has none."""
    for parent in model.modules():
        if any(child is router for child in parent.children()):
            experts = getattr(parent, "experts", None)
            return experts if isinstance(experts, torch.nn.Module) else None
    return None
