"""MoE routing replay through megatron-core's `RouterReplay`: every router of the model routes a
micro-batch's tokens through the experts the rollout engine recorded for them.

megatron-core gives each router a `RouterReplay` (`moe_enable_routing_replay`) whose
`get_replay_topk` decides the top-k. Miles sets the record of the micro-batch before its forward
and wraps each instance's top-k: tokens without a record (-1: padding, or nothing recorded) keep
the router's own choice, and the router's own choice is compared with the record on the way
(`moe/routing_agreement`), which is measured with replay off too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from miles.core.config import ReplayMode
from miles.core.contracts.family import MegatronMapping
from miles.megatron.layout import ParallelLayout


@dataclass
class ReplayStats:
    compared: int = 0  # token-layer pairs with a record
    agreed: int = 0  # ... where the router's own top-k was the recorded set
    replayed: int = 0  # ... routed through the record
    matched: int = 0  # ... whose experts are the record's, as the router handed them on


class RoutingReplay:
    """The record's columns for this rank's routers, in the order megatron-core built them."""

    def __init__(self, mode: ReplayMode, record_columns: list[int]) -> None:
        self.mode = mode
        self.instances = list(RouterReplay.global_router_replay_instances)
        if len(self.instances) != len(record_columns):
            raise RuntimeError(
                f"{len(self.instances)} MoE routers on this rank, {len(record_columns)} expected "
                "from the model's mapping"
            )
        self.columns = record_columns
        self.counting = False
        self.stats = ReplayStats()
        for i, instance in enumerate(self.instances):
            instance.get_replay_topk = partial(self._topk, i)
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def set_record(self, routing: torch.Tensor | None) -> None:
        """The micro-batch's record [tokens, moe layers of the model, top_k] (None: routers
        choose for themselves)."""
        for instance, column in zip(self.instances, self.columns, strict=True):
            instance.clear_indices()
            if routing is not None:
                instance.target_topk_idx = routing[:, column].long()

    def take_stats(self) -> ReplayStats:
        stats, self.stats = self.stats, ReplayStats()
        return stats

    def _topk(
        self,
        index: int,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs, live = default_compute_topk(
            scores, topk, num_groups=num_groups, group_topk=group_topk
        )
        record = self.instances[index].target_topk_idx
        if record is None:
            return probs, live
        record = record.to(live.device)
        has = (record >= 0).all(dim=-1)
        if self.mode != "off":
            chosen = torch.where(has[:, None], record, live)
            probs = torch.where(has[:, None], scores.gather(1, chosen.clamp(min=0)), probs)
        else:
            chosen = live
        if self.counting:
            same = (live.sort(dim=-1).values == record.sort(dim=-1).values).all(dim=-1)
            matched = (chosen.sort(dim=-1).values == record.sort(dim=-1).values).all(dim=-1)
            self.stats.compared += int(has.sum())
            self.stats.agreed += int((same & has).sum())
            if self.mode != "off":
                self.stats.replayed += int(has.sum())
                self.stats.matched += int((matched & has).sum())
        return probs, chosen


def stage_routing_replay(
    mode: ReplayMode, mapping: MegatronMapping, layout: ParallelLayout, pp_rank: int
) -> RoutingReplay | None:
    """The replay of this pipeline stage's routers (None: a dense model or stage): the record
    holds a column per MoE layer of the whole model, and the stage's routers take theirs."""
    if not RouterReplay.global_router_replay_instances:
        return None
    moe_layers = sorted(
        {layer for w in mapping.weights if w.megatron.endswith("mlp.router.weight")
         for layer in w.layers}
    )  # fmt: skip
    stage = layout.stage_layers(int(mapping.transformer["num_layers"]), pp_rank)
    columns = [i for i, layer in enumerate(moe_layers) if layer in stage]
    return RoutingReplay(mode, columns)


def routing_metrics(
    replay: RoutingReplay | None, tp_rank: int, world_size: int, device: torch.device
) -> dict[str, float]:
    """The stats since the last call, summed over the world (collective): "moe/routing_agreement",
    "moe/replayed_tokens" and, when replaying, "moe/replayed_match"; {} without records."""
    if replay is None:
        return {}
    s = replay.take_stats()
    counts = torch.tensor(
        [s.compared, s.agreed, s.replayed, s.matched], dtype=torch.float64, device=device
    )
    # Tensor ranks route the same tokens: count the first's; data ranks and stages add up.
    counts *= float(tp_rank == 0)
    if world_size > 1:
        dist.all_reduce(counts)
    compared, agreed, replayed, matched = counts.tolist()
    if not compared:
        return {}
    metrics = {"moe/routing_agreement": agreed / compared, "moe/replayed_tokens": replayed}
    if replay.mode != "off":
        metrics["moe/replayed_match"] = matched / compared
    return metrics
