"""Sample filters: each takes one group of samples and returns the samples to keep."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from miles.core.contracts.types import Sample, SampleStatus


@dataclass
class DropFailedConfig:
    pass


class DropFailed:
    """Drops samples whose generation or reward failed; their errors stay in the metrics."""

    def __init__(self, config: DropFailedConfig) -> None:
        self.config = config

    def __call__(self, group: list[Sample]) -> list[Sample]:
        return [s for s in group if s.status is not SampleStatus.FAILED]


@dataclass
class DynamicSamplingConfig:
    # Rounds of extra prompts the rollout manager may draw to refill dropped groups (DAPO
    # over-samples until the batch is full); past them the step trains on what it has.
    max_rounds: int = 4
    min_std: float = 0.0  # a group whose reward std is at most this carries no signal

    def __post_init__(self) -> None:
        if self.max_rounds < 0 or self.min_std < 0:
            raise ValueError("max_rounds and min_std must be >= 0")


class DynamicSampling:
    """DAPO's dynamic sampling (Yu et al. 2025): drop groups whose rewards all agree.

    With every reward equal, group-relative advantages are all zero: such a group costs compute
    and gives no gradient. The rollout manager draws more prompts to refill the batch, up to
    `max_rounds` times, and logs `rollout/dropped_group_frac`.
    """

    def __init__(self, config: DynamicSamplingConfig) -> None:
        self.config = config

    @property
    def oversample_rounds(self) -> int:
        """Extra rounds of prompts a step may draw (its spec declares `oversamples`)."""
        return self.config.max_rounds

    def __call__(self, group: list[Sample]) -> list[Sample]:
        rewards = [s.reward for s in group if s.reward is not None]
        if len(rewards) < 2 or statistics.pstdev(rewards) <= self.config.min_std:
            return []
        return group


@dataclass
class LengthConfig:
    min_tokens: int = 0
    max_tokens: int | None = None
    drop_truncated: bool = False  # drop responses cut off at rollout.max_new_tokens


class Length:
    """Keeps samples whose response length lies in [min_tokens, max_tokens]."""

    def __init__(self, config: LengthConfig) -> None:
        self.config = config

    def __call__(self, group: list[Sample]) -> list[Sample]:
        c = self.config
        return [
            s
            for s in group
            if len(s.response_ids) >= c.min_tokens
            and (c.max_tokens is None or len(s.response_ids) <= c.max_tokens)
            and not (c.drop_truncated and s.status is SampleStatus.TRUNCATED)
        ]
