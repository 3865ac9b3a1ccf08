"""Producing a step's samples: the rollout function for every group at once, then reward and
filters per group, with extra rounds of prompts when filters drop whole groups.

Requests of all concurrent groups are batched onto the engines by the dispatcher; each group is
scored as soon as it is done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from miles.core.contracts.protocols import PromptGroup, RolloutFunction, SampleFilter, Tokenizer
from miles.core.contracts.types import GenerateRequest, GenerateResult, Sample, SamplingParams
from miles.core.observability.telemetry import span
from miles.runtime.rollout.buffer import StepBatch
from miles.runtime.rollout.dispatch import EngineDispatcher
from miles.runtime.rollout.scoring import RewardScorer

# More prompt groups, for an extra round: (how many) -> groups.
MoreGroups = Callable[[int], list[PromptGroup]]


class _Context:
    """The `RolloutContext` handed to rollout functions."""

    def __init__(
        self, dispatcher: EngineDispatcher, sampling: SamplingParams, tokenizer: Tokenizer
    ):
        self._dispatcher, self._sampling, self._tokenizer = dispatcher, sampling, tokenizer

    @property
    def sampling(self) -> SamplingParams:
        return self._sampling

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return await self._dispatcher.generate(requests)


class RolloutProducer:
    def __init__(
        self,
        rollout_fn: RolloutFunction,
        scorer: RewardScorer,
        filters: list[SampleFilter],
        dispatcher: EngineDispatcher,
        tokenizer: Tokenizer,
        *,
        oversample_rounds: int = 0,
    ) -> None:
        self.rollout_fn, self.scorer, self.filters = rollout_fn, scorer, filters
        self.dispatcher, self.tokenizer = dispatcher, tokenizer
        self.oversample_rounds = oversample_rounds  # extra rounds the filters may ask for

    async def run_groups(
        self, groups: list[PromptGroup], sampling: SamplingParams
    ) -> list[list[Sample]]:
        """Every group generated and rewarded, concurrently; in group order."""
        ctx = _Context(self.dispatcher, sampling, self.tokenizer)

        async def run_one(group: PromptGroup) -> list[Sample]:
            with span("miles.rollout_group", group=group.group_id):
                samples = await self.rollout_fn(ctx, group)
            with span("miles.reward", group=group.group_id):
                await self.scorer.score(samples)
            return list(samples)

        return list(await asyncio.gather(*(run_one(g) for g in groups)))

    def keep(self, group: list[Sample]) -> list[Sample]:
        for f in self.filters:
            group = f(group)
        return group

    async def produce(
        self, step: int, groups: list[PromptGroup], sampling: SamplingParams, more: MoreGroups
    ) -> StepBatch:
        """A step's batch from `groups`; groups the filters drop are refilled from `more`, up
        to `oversample_rounds` extra rounds."""
        target = len(groups)
        batch = StepBatch(step)
        t0 = time.perf_counter()
        while True:
            await self._add(batch, groups, sampling)
            missing = target - len(batch.kept)
            if missing <= 0 or batch.extra_rounds >= self.oversample_rounds:
                break
            batch.extra_rounds += 1
            groups = more(missing)
        batch.seconds = time.perf_counter() - t0
        return batch

    async def regenerate(
        self, batch: StepBatch, groups: list[PromptGroup], sampling: SamplingParams
    ) -> None:
        """Generates these (stale) groups again into `batch`."""
        await self._add(batch, groups, sampling)

    async def _add(
        self, batch: StepBatch, groups: list[PromptGroup], sampling: SamplingParams
    ) -> None:
        for group, samples in zip(groups, await self.run_groups(groups, sampling), strict=True):
            batch.generated += samples
            kept = self.keep(samples)
            kept_ids = {s.sample_id for s in kept}
            batch.filtered += [s for s in samples if s.sample_id not in kept_ids]
            if kept:
                batch.kept.append((group, kept))
