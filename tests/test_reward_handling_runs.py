"""Reward failures and group filters inside real runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import read_jsonl, run_miles, write_config

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


def test_failing_reward_marks_samples_and_the_run_goes_on(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=1,
        reward={"name": "miles_test_rewards:flaky"},
        filters=["drop_failed"],
        checkpoint={"at_end": False},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["rollout/reward_errors"] == row["rollout/samples"] / 2
    assert row["rollout/kept_samples"] == row["rollout/samples"] / 2  # drop_failed removed them
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert "flaky reward bug" in events


def test_on_error_fail_stops_the_run_with_a_clear_message(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=1,
        reward={"name": "miles_test_rewards:flaky", "on_error": "fail"},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 1
    assert "RewardError: reward 'miles_test_rewards:flaky': RuntimeError: flaky reward bug" in (
        proc.stderr
    )


def test_dynamic_sampling_oversamples_within_its_bound(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    # exact_match scores every response of a random tiny model 0: no group has any signal, so
    # dynamic sampling drops them all, draws more prompts twice, then gives up for the step.
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=1,
        reward="exact_match",
        filters=[{"name": "dynamic_sampling", "max_rounds": 2}],
        checkpoint={"at_end": False},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["rollout/oversample_rounds"] == 2
    assert row["rollout/samples"] == 3 * 4 * 4  # 3 rounds x 4 prompts x 4 samples
    assert row["rollout/dropped_group_frac"] == 1.0 and row["rollout/kept_samples"] == 0
    assert "train/loss" not in row  # nothing to train on: the step is skipped, not crashed


def test_multi_turn_with_the_calculator_runs(tmp_path: Path, tiny_assets: dict[str, str]) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        steps=1,
        reward="env",
        rollout={
            "function": {
                "name": "multi_turn",
                "env": "calculator",
                "max_turns": 3,
                "max_turn_tokens": 4,
            },
            "max_new_tokens": 16,
        },
        checkpoint={"at_end": False},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert row["rollout/reward_errors"] == 0 and row["train/rollout_logprob_abs_diff"] < 1e-4
