"""Sample filters: each takes one group of samples and returns the samples to keep."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.types import Sample, SampleStatus


@dataclass
class DropFailedConfig:
    pass


class DropFailed:
    """Drops samples whose generation or reward failed; their errors stay in the metrics."""

    def __init__(self, config: DropFailedConfig) -> None:
        self.config = config

    def __call__(self, group: list[Sample]) -> list[Sample]:
        return [s for s in group if s.status is not SampleStatus.FAILED]
