"""Where a weight lives in a Megatron-core job: the parallel sizes and one rank's place in them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor (tp), pipeline (pp) and expert (ep) parallel sizes. Routed experts are cut by their
    own tensor-parallel size (etp; Megatron's default: tp)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    # Megatron pads the vocabulary to a multiple of this times tp (make_vocab_size_divisible_by).
    vocab_multiple: int = 128

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def padded_vocab(self, vocab: int) -> int:
        step = self.vocab_multiple * self.tp
        return -(-vocab // step) * step

    def stage_layers(self, num_layers: int, stage: int) -> range:
        """The global decoder layers pipeline stage `stage` holds (an even split)."""
        if num_layers % self.pp:
            raise ValueError(
                f"pipeline parallel size {self.pp} does not divide the model's {num_layers} "
                "layers; choose a pp that divides num_hidden_layers"
            )
        per = num_layers // self.pp
        return range(stage * per, (stage + 1) * per)

    def ranks(self) -> Iterator[Rank]:
        """Every distinct place a weight shard can have (data-parallel copies left out)."""
        for pp, tp, ep, etp in itertools.product(
            range(self.pp), range(self.tp), range(self.ep), range(self.expert_tp)
        ):
            yield Rank(pp=pp, tp=tp, ep=ep, etp=etp)


@dataclass(frozen=True, order=True)
class Rank:
    """One rank's coordinates: pipeline stage, tensor rank, expert rank, expert-tensor rank."""

    pp: int = 0
    tp: int = 0
    ep: int = 0
    etp: int = 0
