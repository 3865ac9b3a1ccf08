"""MoE routing replay in the trainer: a micro-batch's forward routes through the experts the
rollout recorded for it, and `logprobs` reports how well the trainer's own routers agree with
that record. A model without MoE routers (or a batch without records) is left alone."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from miles.core.config import ReplayMode
from miles.torch.routing import RoutingReplay, router_adapter
from miles.torch.train.microbatch import MicroBatch


def routing_replay(model: Any, mode: ReplayMode) -> RoutingReplay | None:
    """A RoutingReplay over `model`'s MoE routers (with mode "off" it only measures agreement);
    None for a model without a router adapter (replay on such a model is refused before launch)."""
    adapter = router_adapter(model, f"routing_replay={mode!r}")
    return None if adapter is None else RoutingReplay(model, adapter, mode)


@contextmanager
def replaying(replay: RoutingReplay | None, mb: MicroBatch, count: bool = False) -> Iterator[None]:
    """Routes `mb` through its recorded experts (MoE with routing replay; else a no-op).
    `count`: measure the routers' agreement with the record meanwhile."""
    if replay is None or mb.routing is None:
        yield
        return
    replay.counting = count
    try:
        with replay.active(mb.routing, mb.routing_weights):
            yield
    finally:
        replay.counting = False


def routing_metrics(
    replay: RoutingReplay | None, world_size: int, device: torch.device
) -> dict[str, float]:
    """Agreement of the trainer's own routers with the rollout record over the last
    `logprobs` call (collective); {} for a model without MoE routers or records."""
    if replay is None:
        return {}
    stats = replay.take_stats()
    counts = torch.tensor(
        [stats.compared, stats.agreed, stats.replayed_tokens, stats.matched],
        dtype=torch.float64,
    )
    if world_size > 1:
        counts = counts.to(device)
        dist.all_reduce(counts)
    compared, agreed, replayed, matched = counts.tolist()
    if not compared:
        return {}
    metrics = {"moe/routing_agreement": agreed / compared, "moe/replayed_tokens": replayed}
    if replay.mode != "off" and replay.verifies:
        # Counted at the experts modules' inputs: 1.0 only if what the experts received
        # was the record; below it when replay did not take hold.
        metrics["moe/replayed_match"] = matched / compared
    return metrics
