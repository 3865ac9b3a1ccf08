"""The sample ledger: ids handed out densely and once, each sample's fate written once, counts
that survive a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.core.contracts.types import Sample, SampleStatus
from miles.runtime.rollout.ledger import SampleLedger


def test_groups_get_dense_unique_ids() -> None:
    ledger = SampleLedger(None)
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    groups = ledger.new_groups(rows, [[1, 2], [3]], samples_per_prompt=3)
    assert [g.group_id for g in groups] == [0, 1]
    assert [g.sample_ids for g in groups] == [[0, 1, 2], [3, 4, 5]]
    assert [g.prompt_ids for g in groups] == [[1, 2], [3]] and groups[1].row == {"prompt": "b"}
    more = ledger.new_groups([{"prompt": "c"}], [[4]], samples_per_prompt=2)
    assert (more[0].group_id, more[0].sample_ids) == (2, [6, 7])
    assert ledger.metrics() == {
        "samples/created": 8.0,
        "samples/trained": 0.0,
        "samples/filtered": 0.0,
        "samples/stale": 0.0,
    }


def test_record_writes_each_sample_with_its_fate_and_status(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    ledger = SampleLedger(path)
    a = Sample(prompt_ids=[1], sample_id=4, group_id=1, reward=0.5, weight_version=[2, 3, 1])
    b = Sample(prompt_ids=[1], sample_id=5, group_id=1, reward=1.0, weight_version=7)
    c = Sample(prompt_ids=[1], sample_id=6, group_id=2, reward=0.0, weight_version=[])
    c.status, c.error = SampleStatus.FAILED, "the agent raised KeyError: 'x'"
    ledger.record([a, b], step=3, fate="trained")
    ledger.record([c], step=4, fate="stale")
    ledger.record([], step=4, fate="filtered")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {
            "sample_id": 4,
            "group_id": 1,
            "step": 4,
            "fate": "trained",
            "reward": 0.5,
            "weight_versions": [1, 3],
            "status": "completed",
        },
        {
            "sample_id": 5,
            "group_id": 1,
            "step": 4,
            "fate": "trained",
            "reward": 1.0,
            "weight_versions": [7, 7],
            "status": "completed",
        },
        {
            "sample_id": 6,
            "group_id": 2,
            "step": 5,
            "fate": "stale",
            "reward": 0.0,
            "weight_versions": [0, 0],
            "status": "failed",
            "error": "the agent raised KeyError: 'x'",
        },
    ]  # fmt: skip  (the loop's index 3 is step 4: samples.jsonl numbers steps from 1)
    assert ledger.metrics()["samples/trained"] == 2.0
    assert ledger.metrics()["samples/stale"] == 1.0
    assert ledger.metrics()["samples/filtered"] == 0.0


def test_without_a_path_it_counts_and_writes_nothing(tmp_path: Path) -> None:
    ledger = SampleLedger(None)
    ledger.record([Sample(prompt_ids=[1], sample_id=0)], step=0, fate="filtered")
    assert ledger.counts["filtered"] == 1 and list(tmp_path.iterdir()) == []


def test_state_round_trips_and_ids_continue() -> None:
    ledger = SampleLedger(None)
    ledger.new_groups([{}, {}], [[1], [2]], samples_per_prompt=2)
    ledger.record([Sample(prompt_ids=[1], sample_id=0)], step=0, fate="trained")
    state = json.loads(json.dumps(ledger.get_state()))  # as a checkpoint's state.json holds it
    assert state == {
        "next_sample_id": 4,
        "next_group_id": 2,
        "counts": {"created": 4, "trained": 1, "filtered": 0, "stale": 0},
    }
    ledger.counts["trained"] = 99  # get_state is a copy, not a view
    assert state["counts"]["trained"] == 1
    resumed = SampleLedger(None)
    resumed.set_state(state)
    (group,) = resumed.new_groups([{}], [[3]], samples_per_prompt=2)
    assert (group.group_id, group.sample_ids) == (2, [4, 5])
    assert resumed.metrics()["samples/created"] == 6.0
    assert resumed.metrics()["samples/trained"] == 1.0
    # An older checkpoint without counts keeps the fresh ones.
    old = SampleLedger(None)
    old.set_state({"next_sample_id": "8", "next_group_id": "3"})
    assert (old.next_sample_id, old.next_group_id, old.counts["created"]) == (8, 3, 0)


def test_rows_and_prompts_of_different_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="zip"):
        SampleLedger(None).new_groups([{}, {}], [[1]], samples_per_prompt=2)
