"""Megatron-core shards back to whole Hugging Face tensors, one unit (a layer's dense weights, a
layer's experts, the embedding, the head) at a time, on every rank.

Each shard is sent by one rank only: among the ranks holding a copy (data-parallel replicas,
dense weights on every expert rank, experts on every tensor rank) the one with the smallest
coordinates broadcasts it, which is the copy `convert.gather` reads. A run of one rank sends
nothing. Every rank then holds the unit's full tensors (a colocated engine on each rank's GPU
takes them from there), and only one unit's at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from miles.core.contracts.family import MegatronMapping
from miles.megatron.convert import gather, is_expert, local_names, split_by_layer
from miles.megatron.layout import ParallelLayout, Rank


@dataclass(frozen=True)
class RankInfo:
    """What every rank knows of every other, exchanged once: its coordinates and the shapes and
    dtypes of the parameters it holds."""

    coords: Rank
    shapes: dict[str, tuple[tuple[int, ...], str]]


def exchange_rank_info(coords: Rank, params: Mapping[str, torch.Tensor]) -> list[RankInfo]:
    """Every rank's `RankInfo`, in global rank order (collective; metadata only)."""
    mine = RankInfo(
        coords,
        {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in params.items()},
    )
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone: list[RankInfo | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [r for r in everyone if r is not None]


class ShardGather:
    """Whole Hugging Face tensors from this job's Megatron shards (see the module docstring)."""

    def __init__(
        self,
        mapping: MegatronMapping,
        layout: ParallelLayout,
        ranks: list[RankInfo],
        me: int,
        device: torch.device,
    ) -> None:
        self.mapping, self.layout, self.ranks, self.me = mapping, layout, ranks, me
        self.device = device
        self.units = split_by_layer(mapping)
        # (unit, local name) -> the global ranks that send it, with their coordinates
        self._senders = [self._plan(unit) for unit in self.units]

    def _plan(self, unit: MegatronMapping) -> list[tuple[int, Rank, str]]:
        """(sending rank, its coordinates, local name) of every shard of the unit, in the order
        every rank broadcasts them."""
        chosen: dict[tuple[object, ...], tuple[tuple[Rank, int], str]] = {}
        for rank, info in enumerate(self.ranks):
            c = info.coords
            for name in local_names(unit, self.layout, c):
                key = (name, c.pp, c.ep, c.etp) if is_expert(name) else (name, c.pp, c.tp)
                best = chosen.get(key)
                if best is None or (c, rank) < best[0]:
                    chosen[key] = ((c, rank), name)
        return sorted((rank, c, name) for (c, rank), name in chosen.values())

    def named(
        self, local: Callable[[str], torch.Tensor], dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, whole tensor) of every weight, unit by unit, on every rank.
        `local(name)` is this rank's tensor of a local-spec parameter (the weight, or its
        optimizer state); `dtype` what it is sent as (default: the parameter's). Collective."""
        for unit, senders in zip(self.units, self._senders, strict=True):
            shards: dict[Rank, dict[str, torch.Tensor]] = {}
            for rank, coords, name in senders:
                shape, own_dtype = self.ranks[rank].shapes[name]
                want = dtype or getattr(torch, own_dtype)
                if rank == self.me:
                    t = local(name).detach().to(self.device, want).contiguous()
                else:
                    t = torch.empty(shape, dtype=want, device=self.device)
                if len(self.ranks) > 1:
                    dist.broadcast(t, src=rank)
                shards.setdefault(coords, {})[name] = t
            yield from gather(shards, unit, self.layout).items()
