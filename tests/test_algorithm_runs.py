"""Algorithm settings through a real run: a third-party loss by name, corrections, KL modes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .conftest import read_jsonl, run_miles, write_config

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


def test_third_party_loss_plugin_by_name(tmp_path: Path, tiny_assets: dict[str, str]) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml",
        tiny_assets,
        algorithm={"loss": {"name": "scaled_pg", "scale": 2.0}},
        checkpoint={"at_end": False},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert "train/clipfrac" not in rows[0]  # the plugin's loss ran, not ppo_clip
    listed = run_miles("plugins", "show", "miles-test-loss-plugin", timeout=60)
    assert "loss/scaled_pg" in listed.stdout


def test_bad_plugin_loss_options_fail_before_start(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml", tiny_assets, algorithm={"loss": {"name": "scaled_pg", "scal": 2.0}}
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=60)
    assert proc.returncode == 2
    assert "algorithm.loss.scal: unknown key; did you mean 'scale'?" in proc.stderr


def test_off_policy_modes_need_a_correction(tmp_path: Path, tiny_assets: dict[str, str]) -> None:
    cfg = write_config(tmp_path / "cfg.yaml", tiny_assets, mode="one_step_off")
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=60)
    assert proc.returncode == 2
    assert "set algorithm.correction (tis, mis or icepop) or algorithm.old_logprobs: rollout" in (
        proc.stderr
    )


@pytest.mark.parametrize(
    ("algorithm", "expected_keys"),
    [
        (
            {
                "correction": {"name": "tis", "cap": 2.0},
                "kl": {"coef": 0.01, "mode": "reward"},
                "entropy_coef": 0.001,
                "advantage": "rloo",
            },
            {"train/kl_reward_penalty", "train/is_clipfrac", "train/ess_ratio"},
        ),
        (
            {
                "old_logprobs": "rollout",
                "kl": {"coef": 0.01, "estimator": "low_var_kl"},
                "aggregation": "seq_mean_token_sum",
                "seq_sum_normalizer": 6.0,
                "loss": {"name": "gspo"},
                "advantage": "reinforce_pp_baseline",
            },
            {"train/kl_ref", "train/clipfrac"},
        ),
        (
            # PPO with a critic: GAE advantages, a value model trained with the clipped value loss.
            {
                "advantage": {"name": "gae", "gamma": 1.0, "lam": 0.95},
                "kl": {"coef": 0.01, "mode": "reward"},
                "value_loss": {"name": "value", "clip": 0.2},
            },
            {"critic/loss", "critic/grad_norm", "critic/values_mean", "critic/value_error"},
        ),
    ],
)
def test_algorithm_settings_run_end_to_end(
    tmp_path: Path, tiny_assets: dict[str, str], algorithm: dict[str, Any], expected_keys: set[str]
) -> None:
    cfg = write_config(
        tmp_path / "cfg.yaml", tiny_assets, algorithm=algorithm, checkpoint={"at_end": False}
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert expected_keys <= rows[0].keys(), expected_keys - rows[0].keys()
    assert all(np.isfinite(r["train/loss"]) and r["train/grad_norm"] > 0 for r in rows)


def test_the_tis_cap_sets_how_many_ratios_are_clipped(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """An option changes what it should: one step off policy, the train/rollout ratios spread
    around 1. A cap of 1 clips every ratio above 1 (about half the tokens); a cap far above any
    ratio clips none. Same seed, same batches: only the cap differs."""
    clipfrac = {}
    for cap in (1.0, 1000.0):
        cfg = write_config(
            tmp_path / f"cap{cap}.yaml",
            tiny_assets,
            mode="one_step_off",
            steps=3,
            algorithm={"correction": {"name": "tis", "cap": cap}},
            checkpoint={"at_end": False},
        )
        proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / f"cap{cap}"))
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = read_jsonl(tmp_path / f"cap{cap}" / "metrics.jsonl")
        clipfrac[cap] = [r["train/is_clipfrac"] for r in rows[1:]]  # steps 1+: off policy
    assert all(0.1 < f < 0.9 for f in clipfrac[1.0]), clipfrac
    assert clipfrac[1000.0] == [0.0] * len(clipfrac[1000.0]), clipfrac
