"""The buffer policy: the one thing that makes sync, one_step_off and async differ.

The loop is the same in every mode: the rollout manager produces step batches into a buffer, the
trainer takes batch s, trains, and the new weights go to the engines. The policy decides

- how far ahead rollout may start (`lookahead`): batch s may start once the weights made by step
  s - 1 - lookahead are on the engines. sync: 0 (on-policy), one_step_off: 1, async: max_staleness;
- how many groups the buffer may hold, finished or in flight (`capacity`);
- whether a weight update waits for the batches in flight to finish (sync, one_step_off) or
  pauses them mid-generation, to finish with the new weights (async: partial rollouts);
- how old a sample may be when the trainer takes it (`max_staleness`, in weight versions), and
  what happens to an older one (`stale`: drop it, or generate it again).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from miles.core.config import RunConfig
from miles.core.protocols import PromptGroup
from miles.core.types import Sample, SampleStatus, oldest_version


@dataclass(frozen=True)
class BufferPolicy:
    lookahead: int
    capacity: int  # groups
    max_staleness: int
    stale: Literal["drop", "regenerate"]
    interrupt_on_update: bool

    @classmethod
    def from_config(cls, config: RunConfig) -> BufferPolicy:
        per_step = config.rollout.prompts_per_step
        a = config.async_
        if config.mode == "sync":
            return cls(0, per_step, 0, a.stale, interrupt_on_update=False)
        if config.mode == "one_step_off":
            return cls(1, 2 * per_step, 1, a.stale, interrupt_on_update=False)
        capacity = a.buffer_size or (a.max_staleness + 1) * per_step
        return cls(a.max_staleness, capacity, a.max_staleness, a.stale, interrupt_on_update=True)

    def may_start(self, step: int, synced_through: int, groups_held: int, groups: int) -> bool:
        """Whether batch `step` (of `groups` groups) may start, when the engines hold the weights
        made by step `synced_through` and the buffer holds `groups_held` groups. A batch larger
        than the capacity still starts into an empty buffer."""
        fresh_enough = step - 1 - self.lookahead <= synced_through
        has_room = groups_held + groups <= self.capacity or groups_held == 0
        return fresh_enough and has_room

    def staleness(self, sample: Sample, version: int) -> int:
        return max(version - oldest_version(sample.weight_version), 0)

    def is_stale(self, sample: Sample, version: int) -> bool:
        return self.staleness(sample, version) > self.max_staleness


@dataclass
class StepBatch:
    """One step's rollout as produced: the kept groups (with the prompt group each came from, to
    generate it again if it goes stale), every generated sample, and what the filters dropped."""

    step: int
    kept: list[tuple[PromptGroup, list[Sample]]] = field(default_factory=list)
    generated: list[Sample] = field(default_factory=list)  # kept or not: the rollout metrics
    filtered: list[Sample] = field(default_factory=list)
    extra_rounds: int = 0
    seconds: float = 0.0

    @property
    def num_groups(self) -> int:
        return len(self.kept)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready (checkpoints hold no pickle). Kept samples are stored once, by index."""
        index = {id(s): i for i, s in enumerate(self.generated)}
        return {
            "step": self.step,
            "samples": [_sample_to_json(s) for s in self.generated],
            "kept": [
                {"group": dataclasses.asdict(g), "samples": [index[id(s)] for s in samples]}
                for g, samples in self.kept
            ],
            "filtered": [index[id(s)] for s in self.filtered],
            "extra_rounds": self.extra_rounds,
            "seconds": self.seconds,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepBatch:
        samples = [_sample_from_json(s) for s in data["samples"]]
        return cls(
            step=int(data["step"]),
            kept=[
                (PromptGroup(**k["group"]), [samples[i] for i in k["samples"]])
                for k in data["kept"]
            ],
            generated=samples,
            filtered=[samples[i] for i in data["filtered"]],
            extra_rounds=int(data["extra_rounds"]),
            seconds=float(data["seconds"]),
        )


_ARRAYS = ("routing", "routing_weights")


def _sample_to_json(sample: Sample) -> dict[str, Any]:
    out = {f.name: getattr(sample, f.name) for f in dataclasses.fields(sample)}
    out["status"] = sample.status.value
    for key in _ARRAYS:
        array = out[key]
        if array is not None:
            out[key] = {"dtype": str(array.dtype), "data": array.tolist()}
    return out


def _sample_from_json(data: dict[str, Any]) -> Sample:
    data = dict(data)
    data["status"] = SampleStatus(data["status"])
    for key in _ARRAYS:
        if data.get(key) is not None:
            data[key] = np.asarray(data[key]["data"], dtype=data[key]["dtype"])
    return Sample(**data)
