"""BatchBuffer (the one_step_off/async buffer) against a fake producer, and every field of each
mode's BufferPolicy: which batches start when, what a checkpoint holds, close/open, fail-fast.

No Ray: a batch is a coroutine that finishes when the test releases it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

import pytest

from miles.core.config import parse
from miles.core.contracts.protocols import PromptGroup
from miles.core.contracts.types import Sample
from miles.runtime.rollout.buffer import BatchBuffer, BufferPolicy, StepBatch

PER_STEP = 4


def _policy(mode: str, **async_: object) -> BufferPolicy:
    return BufferPolicy.from_config(
        parse({"mode": mode, "rollout": {"prompts_per_step": PER_STEP}, "async": async_})
    )


@pytest.mark.parametrize(
    ("mode", "async_", "expected"),
    [
        ("sync", {}, BufferPolicy(0, PER_STEP, 0, "drop", interrupt_on_update=False)),
        (
            "one_step_off",
            {"stale": "regenerate"},
            BufferPolicy(1, 2 * PER_STEP, 1, "regenerate", interrupt_on_update=False),
        ),
        ("async", {}, BufferPolicy(1, 2 * PER_STEP, 1, "drop", interrupt_on_update=True)),
        (
            "async",
            {"max_staleness": 3},
            BufferPolicy(3, 4 * PER_STEP, 3, "drop", interrupt_on_update=True),
        ),
        (
            "async",
            {"max_staleness": 2, "buffer_size": 5, "stale": "regenerate"},
            BufferPolicy(2, 5, 2, "regenerate", interrupt_on_update=True),
        ),
    ],
)
def test_each_mode_gives_its_whole_policy(
    mode: str, async_: dict[str, Any], expected: BufferPolicy
) -> None:
    policy = _policy(mode, **async_)
    assert policy == expected
    assert type(policy.capacity) is int


def test_step_batch_json_keeps_rounds_and_seconds() -> None:
    sample = Sample(prompt_ids=[1], response_ids=[2], sample_id=0)
    group = PromptGroup(group_id=0, prompt_ids=[1], row={}, sample_ids=[0])
    batch = StepBatch(2, [(group, [sample])], [sample], [], extra_rounds=3, seconds=1.5)
    back = StepBatch.from_json(json.loads(json.dumps(batch.to_json())))
    assert (back.step, back.extra_rounds, back.seconds) == (2, 3, 1.5)
    assert back.num_groups == 1 and back.filtered == []


class Producer:
    """`start` for BatchBuffer: records the steps started; batch s finishes on `release(s)`."""

    def __init__(self) -> None:
        self.started: list[int] = []
        self._events: dict[int, asyncio.Event] = {}

    def _event(self, step: int) -> asyncio.Event:
        return self._events.setdefault(step, asyncio.Event())

    def release(self, *steps: int) -> None:
        for step in steps:
            self._event(step).set()

    def __call__(self, step: int) -> Coroutine[Any, Any, StepBatch]:
        self.started.append(step)
        event = self._event(step)

        async def produce() -> StepBatch:
            await event.wait()
            return StepBatch(step, seconds=float(step))

        return produce()


def _buffer(
    mode: str, producer: Producer, steps: int = 10, check: Any = None, **async_: object
) -> BatchBuffer:
    return BatchBuffer(
        _policy(mode, **async_),
        steps=steps,
        groups_per_step=PER_STEP,
        start=producer,
        check=check or (lambda: None),
    )


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_nothing_starts_before_begin() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("async", producer, max_staleness=2)
        buffer.fill()
        buffer.weights_updated(1, 0)
        buffer.open()
        assert producer.started == [] and buffer.groups_held == 0

    asyncio.run(main())


def test_taking_a_batch_that_never_started_fails_loudly() -> None:
    async def main() -> None:
        buffer = _buffer("sync", Producer())
        with pytest.raises(RuntimeError, match=r"batch 0 has not started .*weights of step -1\)"):
            await buffer.take(0)

    asyncio.run(main())


def test_sync_starts_one_batch_per_weight_update() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("sync", producer)
        buffer.begin(0, version=0)
        assert producer.started == [0]
        assert (buffer.next_step, buffer.synced_through, buffer.version) == (1, -1, 0)
        assert buffer.groups_held == PER_STEP
        producer.release(0)
        batch = await buffer.take(0)
        assert batch.step == 0 and batch.seconds == 0.0
        assert buffer.groups_held == 0
        assert producer.started == [0]  # step 1 needs the weights step 0 makes
        buffer.weights_updated(version=1, synced_through=0)
        assert producer.started == [0, 1]
        assert (buffer.next_step, buffer.synced_through, buffer.version) == (2, 0, 1)
        with pytest.raises(RuntimeError, match="batch 2 has not started"):
            await buffer.take(2)

    asyncio.run(main())


def test_one_step_off_runs_one_batch_ahead() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("one_step_off", producer)
        buffer.begin(0, version=0)
        assert producer.started == [0, 1]
        assert buffer.groups_held == 2 * PER_STEP
        producer.release(0, 1)
        assert (await buffer.take(0)).step == 0
        buffer.fill()
        assert producer.started == [0, 1]  # fresh enough for step 2 only once step 0 is synced
        buffer.weights_updated(1, 0)
        assert producer.started == [0, 1, 2]
        assert (await buffer.take(1)).step == 1

    asyncio.run(main())


def test_async_stops_at_the_capacity_and_the_last_step() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("async", producer, steps=3, max_staleness=5, buffer_size=2 * PER_STEP)
        buffer.begin(0, version=0)
        assert producer.started == [0, 1]  # full: two steps' worth of groups
        producer.release(0, 1, 2)
        await buffer.take(0)
        assert producer.started == [0, 1]
        buffer.fill()
        assert producer.started == [0, 1, 2]  # the take made room
        await buffer.take(1)
        await buffer.take(2)
        buffer.weights_updated(3, 2)
        assert producer.started == [0, 1, 2] and buffer.next_step == 3  # steps=3: no step 3

    asyncio.run(main())


def test_begin_at_a_later_step() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("sync", producer)
        buffer.begin(5, version=7)
        assert producer.started == [5]
        assert (buffer.next_step, buffer.synced_through, buffer.version) == (6, 4, 7)

    asyncio.run(main())


def test_closed_buffer_starts_nothing_until_opened() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("one_step_off", producer)
        buffer.begin(0, version=0)
        closing = asyncio.ensure_future(buffer.close())
        await _settle()
        assert not closing.done()  # waits for the batches in flight
        producer.release(0, 1)
        await closing
        await buffer.take(0)
        buffer.weights_updated(1, 0)
        assert producer.started == [0, 1]
        buffer.open()
        assert producer.started == [0, 1, 2]

    asyncio.run(main())


def test_snapshot_finishes_the_batches_in_flight_and_restores() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("one_step_off", producer)
        buffer.begin(0, version=0)
        snap = asyncio.ensure_future(buffer.snapshot())
        await _settle()
        assert not snap.done()
        buffer.weights_updated(1, 0)  # no batch starts while the snapshot waits
        producer.release(0)
        await _settle()
        assert not snap.done()
        producer.release(1)
        saved = await snap
        assert [b["step"] for b in saved] == [0, 1]
        assert producer.started == [0, 1]
        saved = json.loads(json.dumps(saved))
        # The snapshot is over: batches start again once there is room.
        await buffer.take(0)
        buffer.fill()
        assert producer.started == [0, 1, 2]

        # A new buffer from the checkpoint: the finished batches come back, unstarted.
        again = Producer()
        restored = _buffer("one_step_off", again)
        restored.restore(saved)
        restored.next_step = 2  # as the rollout manager restores it
        assert again.started == []
        restored.begin(0, version=0)
        assert again.started == []  # full (two steps held), and step 2 needs step 0's weights
        assert restored.groups_held == 2 * PER_STEP
        first = await restored.take(0)
        assert (first.step, first.seconds) == (0, 0.0)
        restored.weights_updated(1, 0)
        assert again.started == [2]
        assert (await restored.take(1)).step == 1

    asyncio.run(main())


def test_waiting_checks_for_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    real_wait = asyncio.wait

    async def quick_wait(fs: Any, *, timeout: float | None = None) -> Any:
        assert timeout is not None and timeout > 0
        return await real_wait(fs, timeout=0.01)

    class EngineDown(Exception):
        pass

    calls: list[int] = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise EngineDown

    async def main() -> None:
        monkeypatch.setattr(asyncio, "wait", quick_wait)
        producer = Producer()
        buffer = _buffer("sync", producer, check=check)
        buffer.begin(0, version=0)
        with pytest.raises(EngineDown):
            await buffer.take(0)
        assert len(calls) == 3
        producer.release(0)
        calls.clear()
        assert (await buffer.take(0)).step == 0  # still held: the failed take removed nothing

    asyncio.run(main())


def test_a_sample_of_the_current_weights_is_not_stale() -> None:
    fresh = Sample(prompt_ids=[1], response_ids=[2], weight_version=[5])
    policy = _policy("sync")
    assert policy.staleness(fresh, 5) == 0 and not policy.is_stale(fresh, 5)
    assert policy.staleness(fresh, 3) == 0  # weights newer than the trainer's count as fresh


def test_concurrent_snapshots_leave_the_buffer_running() -> None:
    async def main() -> None:
        producer = Producer()
        buffer = _buffer("sync", producer)
        buffer.begin(0, version=0)
        first = asyncio.ensure_future(buffer.snapshot())
        second = asyncio.ensure_future(buffer.snapshot())
        await _settle()
        producer.release(0)
        assert [b["step"] for b in await first] == [0]
        assert [b["step"] for b in await second] == [0]
        await buffer.take(0)
        buffer.weights_updated(1, 0)
        assert producer.started == [0, 1]

    asyncio.run(main())
