"""Algorithm settings through a real run: a third-party loss by name, corrections, KL modes."""

from __future__ import annotations

from pathlib import Path

from .conftest import read_jsonl, run_miles, write_config


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
