"""The buffer policy of each mode, and step batches through JSON (as checkpoints hold them)."""

from __future__ import annotations

import numpy as np
import pytest

from miles.core.config import parse
from miles.core.contracts.protocols import PromptGroup
from miles.core.contracts.types import Sample, SampleStatus
from miles.runtime.rollout.buffer import BufferPolicy, StepBatch


def _policy(mode: str, **async_: object) -> BufferPolicy:
    return BufferPolicy.from_config(
        parse({"mode": mode, "rollout": {"prompts_per_step": 4}, "async": async_})
    )


@pytest.mark.parametrize(
    ("mode", "async_", "ahead"),
    [("sync", {}, 0), ("one_step_off", {}, 1), ("async", {"max_staleness": 3}, 3)],
)
def test_how_far_each_mode_runs_ahead(mode: str, async_: dict[str, int], ahead: int) -> None:
    policy = _policy(mode, **async_)
    synced_through = 4  # the engines hold the weights step 4 made
    starts = [s for s in range(5, 12) if policy.may_start(s, synced_through, 0, 4)]
    assert starts == list(range(5, 6 + ahead))


def test_a_full_buffer_stops_new_batches() -> None:
    policy = _policy("async", max_staleness=3, buffer_size=8)
    assert policy.capacity == 8
    assert policy.may_start(5, 4, 4, 4)
    assert not policy.may_start(5, 4, 8, 4)
    assert policy.may_start(5, 4, 0, 12)  # an oversized batch still starts into an empty buffer


def test_staleness_counts_from_the_oldest_token() -> None:
    policy = _policy("async", max_staleness=1)
    partial = Sample(prompt_ids=[1], response_ids=[2, 3, 4], weight_version=[3, 3, 5])
    assert policy.staleness(partial, 5) == 2
    assert policy.is_stale(partial, 5)
    assert not policy.is_stale(Sample(prompt_ids=[1], weight_version=4), 5)
    assert _policy("sync").is_stale(Sample(prompt_ids=[1], weight_version=4), 5)


def test_step_batch_round_trips_through_json() -> None:
    import json

    kept = Sample(
        prompt_ids=[1, 2],
        response_ids=[3],
        rollout_logprobs=[-0.5],
        reward=1.0,
        sample_id=7,
        weight_version=[2],
        routing=np.array([[[1, 2]]], dtype=np.uint8),
        metadata={"answer": "x"},
    )
    dropped = Sample(prompt_ids=[1, 2], sample_id=8, status=SampleStatus.FAILED, error="boom")
    group = PromptGroup(group_id=3, prompt_ids=[1, 2], row={"prompt": "p"}, sample_ids=[7, 8])
    batch = StepBatch(6, kept=[(group, [kept])], generated=[kept, dropped], filtered=[dropped])
    back = StepBatch.from_json(json.loads(json.dumps(batch.to_json())))
    assert back.step == 6 and back.kept[0][0] == group
    restored = back.kept[0][1][0]
    assert restored.routing is not None and restored.routing.dtype == np.uint8
    assert np.array_equal(restored.routing, kept.routing)
    assert restored.weight_version == [2] and restored.metadata == {"answer": "x"}
    assert back.filtered[0].status is SampleStatus.FAILED
    assert back.kept[0][1][0] is back.generated[0]  # stored once, shared
