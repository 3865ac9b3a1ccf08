"""Config parsing and overrides, the prompt source, and loss weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from miles.core.config import ComponentRef, ConfigError, apply_overrides, parse, parse_partial
from miles.core.config.tools import build
from miles.core.contracts.algorithm import loss_weights
from miles.core.contracts.types import PackedBatch, Sample, split_by_token_budget
from miles.runtime.data.source import PromptSource, read_jsonl


@dataclass
class _BackendConfig:
    lr: float = 0.1


def test_overrides_are_typed_and_nested() -> None:
    data = apply_overrides(
        {"rollout": {"temperature": 1.0}},
        ["seed=7", "mode=sync", "rollout.stop=[a, b]", "train.lr=1e-4"],
    )
    config = parse(data)
    assert config.seed == 7 and config.rollout.stop == ["a", "b"]
    assert config.train.options == {"lr": "1e-4"}  # backend options stay with the backend...
    assert build(_BackendConfig, config.train.options).lr == 1e-4  # ...whose config reads them
    with pytest.raises(ConfigError, match=r"expected key\.path=value"):
        apply_overrides({}, ["seed"])


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        parse({"stepz": 3, "mode": "fast", "eval": {"every": "often"}})
    text = str(err.value)
    assert "stepz: unknown key; did you mean 'steps'?" in text
    assert "mode: 'fast' is not one of" in text
    assert "eval.every: expected an integer" in text


def test_set_reaches_a_component_option_whichever_way_its_section_was_written() -> None:
    # docs/precision.md: --set precision=int4-qat --set precision.group_size=32
    for data in ({}, {"precision": "int4-qat"}, {"precision": {"name": "int4-qat"}}):
        overrides = ["precision.group_size=32"] if data else ["precision=int4-qat"]
        out = apply_overrides(data, [*overrides, "precision.group_size=32"])
        assert parse(out).precision == ComponentRef("int4-qat", {"group_size": 32}), data
    # A bare-name component nested deeper, and a null section, open the same way.
    out = apply_overrides(
        {"rollout": {"function": "multi_turn"}, "lora": None},
        ["rollout.function.env=calculator", "lora.rank=4"],
    )
    config = parse(out)
    assert config.rollout.function == ComponentRef("multi_turn", {"env": "calculator"})
    assert config.lora is not None and config.lora.rank == 4
    # A plain value is still not a section.
    with pytest.raises(ConfigError, match="steps is 3, not a section"):
        apply_overrides({"steps": 3}, ["steps.x=1"])


def test_partial_parse_keeps_going_past_bad_values() -> None:
    config, problems = parse_partial({"mode": "asynch", "steps": 5, "rollout": {"top_k": "x"}})
    assert config.mode == "sync" and config.steps == 5  # the bad value at its default
    assert config.rollout.top_k == -1
    assert len(problems) == 2 and problems[0].startswith("mode:")


def test_config_round_trips_through_to_dict() -> None:
    config = parse({"async": {"max_staleness": 3}, "reward": "exact_match", "train": {"lr": 0.1}})
    again = parse(config.to_dict())
    assert again == config and config.to_dict()["async"]["max_staleness"] == 3


def test_prompt_source_is_deterministic_and_resumable(tmp_path: Path) -> None:
    rows = [{"prompt": str(i)} for i in range(5)]
    a, b = PromptSource(rows, seed=1), PromptSource(rows, seed=1)
    first = a.next(7)
    assert first == b.next(7) and a.state.epoch == 1
    assert sorted(r["prompt"] for r in first[:5]) == [str(i) for i in range(5)]
    state = a.get_state()
    expected = a.next(4)
    c = PromptSource(rows, seed=1)
    c.set_state(state)
    assert c.next(4) == expected
    assert PromptSource(rows, seed=2).next(5) != first[:5]


def test_jsonl_errors_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{not json}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        read_jsonl(str(path))


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_loss_weights_sum_the_same_over_any_micro_batching(aggregation: str) -> None:
    rng = np.random.default_rng(0)
    samples = [
        Sample(prompt_ids=[1] * 3, response_ids=[2] * int(n)) for n in rng.integers(1, 9, 12)
    ]
    batch = PackedBatch.from_samples(samples)
    w = loss_weights(batch, aggregation, seq_sum_normalizer=8.0)  # type: ignore[arg-type]
    per_token_loss = rng.normal(size=w.shape)
    one_shot = float((w * per_token_loss).sum())
    for budget in (5, 11, 1000):
        parts = split_by_token_budget(batch.seq_lens, budget)
        total = 0.0
        for part in parts:
            idx = np.concatenate([np.arange(batch.offsets[i], batch.offsets[i + 1]) for i in part])
            total += float((w[idx] * per_token_loss[idx]).sum())
        assert total == pytest.approx(one_shot, rel=1e-6)
    if aggregation == "token_mean":
        assert w.sum() == pytest.approx(1.0)


def test_parquet_rows_through_hf_datasets(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from miles.runtime.data.source import read_rows

    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), path)
    assert read_rows(str(path)) == [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


def test_a_bare_off_in_yaml_means_the_word() -> None:
    """YAML 1.1 reads `off` as False: a setting whose values include "off" takes it back."""
    data = apply_overrides({}, ["moe.routing_replay=off"])
    assert data["moe"]["routing_replay"] is False  # what YAML made of it
    assert parse(data).moe.routing_replay == "off"
    with pytest.raises(ConfigError, match="True is not one of"):
        parse({"mode": True})
