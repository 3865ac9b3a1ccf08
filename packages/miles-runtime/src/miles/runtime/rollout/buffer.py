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

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from miles.core.config import RunConfig
from miles.core.contracts.protocols import PromptGroup
from miles.core.contracts.types import Sample, SampleStatus, oldest_version


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


class BatchBuffer:
    """Step batches by step, in flight (a task) or finished, and when the next may start.

    `start(step)` draws the step's prompts at once (so the data order does not depend on how
    batches in flight interleave) and returns the coroutine that produces its batch. `check` is
    called while waiting, to fail fast (an engine past its restart budget).
    """

    def __init__(
        self,
        policy: BufferPolicy,
        *,
        steps: int,
        groups_per_step: int,
        start: Callable[[int], Coroutine[Any, Any, StepBatch]],
        check: Callable[[], None],
    ) -> None:
        self.policy, self.steps, self.groups_per_step = policy, steps, groups_per_step
        self._start, self._check = start, check
        self._batches: dict[int, asyncio.Future[StepBatch]] = {}
        self._restored: dict[int, StepBatch] = {}  # finished batches read from a checkpoint
        self.next_step = 0  # the next batch to start
        self.synced_through = -1  # the engines hold the weights made by this step
        self.version = 0  # ... which have this weight version
        self._started = False  # no batch before `begin`
        self._open = True  # colocated runs close generation while the trainer holds the GPU
        self._frozen = 0  # > 0 while a checkpoint waits for the batches in flight

    @property
    def groups_held(self) -> int:
        return self.groups_per_step * len(self._batches)

    def begin(self, first_step: int, version: int) -> None:
        """Batches begin at `first_step`, with the engines at weight `version`."""
        self.synced_through, self.version = first_step - 1, version
        self.next_step = max(self.next_step, first_step)
        for step, batch in sorted(self._restored.items()):
            future: asyncio.Future[StepBatch] = asyncio.get_running_loop().create_future()
            future.set_result(batch)
            self._batches[step] = future
        self._restored = {}
        self._started = True
        self.fill()

    def fill(self) -> None:
        """Starts every batch the policy allows now."""
        while self._started and self._open and not self._frozen and self.next_step < self.steps:
            step = self.next_step
            if not self.policy.may_start(
                step, self.synced_through, self.groups_held, self.groups_per_step
            ):
                return
            self.next_step += 1
            self._batches[step] = asyncio.ensure_future(self._start(step))

    async def take(self, step: int) -> StepBatch:
        """Batch `step`, once finished."""
        self.fill()
        if step not in self._batches:
            raise RuntimeError(
                f"rollout batch {step} has not started (the engines hold the weights of step "
                f"{self.synced_through}); the controller and the rollout manager disagree"
            )
        batch = await self._wait(self._batches[step])
        del self._batches[step]
        return batch

    async def finish_in_flight(self) -> None:
        for future in list(self._batches.values()):
            await self._wait(future)

    def weights_updated(self, version: int, synced_through: int) -> None:
        self.version, self.synced_through = version, synced_through
        self.fill()

    async def close(self) -> None:
        """No batch starts until `open`; returns when those in flight are done."""
        self._open = False
        await self.finish_in_flight()

    def open(self) -> None:
        self._open = True
        self.fill()

    async def snapshot(self) -> list[dict[str, Any]]:
        """Every batch, finished first (none starts meanwhile), as JSON for a checkpoint."""
        self._frozen += 1
        try:
            await self.finish_in_flight()
            return [f.result().to_json() for f in self._batches.values()]
        finally:
            self._frozen -= 1

    def restore(self, batches: list[dict[str, Any]]) -> None:
        self._restored = {int(b["step"]): StepBatch.from_json(b) for b in batches}

    async def _wait(self, future: asyncio.Future[StepBatch]) -> StepBatch:
        while True:
            done, _ = await asyncio.wait({future}, timeout=1.0)
            if done:
                return future.result()
            self._check()


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
