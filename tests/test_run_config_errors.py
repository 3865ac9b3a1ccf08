"""Bad configs fail before any worker starts, naming the key path and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import run_miles, write_config

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["mode=asynch"],
            "mode: 'asynch' is not one of 'sync', 'one_step_off', 'async'; did you mean 'async'?",
        ),
        (
            ["rollout.temperatur=0.5"],
            "rollout.temperatur: unknown key; did you mean 'temperature'?",
        ),
        (
            ["reward.name=exact_matc"],
            "reward: unknown reward 'exact_matc'; did you mean 'exact_match'?",
        ),
        (
            ["reward.name=exact_match", "reward.answer_kee=x"],
            "reward.answer_kee: unknown key; did you mean 'answer_key'?",
        ),
        (["train.lr_schedul=cosine"], "train.lr_schedul: unknown key; did you mean 'lr_schedule'?"),
        (["steps=many"], "steps: expected an integer, got 'many'"),
        (
            ["steps=3", "telemetry.profile_steps=[1, 4]"],
            "telemetry.profile_steps: [4] are not steps of this run (1 to 3)",
        ),
        (["rollout.samples_per_prompt=0"], "rollout.samples_per_prompt must be at least 1"),
        (
            ["algorithm.loss=ppo_clipp"],
            "algorithm.loss: unknown loss 'ppo_clipp'; did you mean 'ppo_clip'?",
        ),
        (["data.path=/nope/missing.jsonl"], "/nope/missing.jsonl: file not found"),
        (
            ["model.path=/nope/model.gguf"],
            "model.path: GGUF checkpoint not found: /nope/model.gguf",
        ),
        (
            ["model.path=/nope", "model.gguf_file=m.gguf"],
            "model.path: GGUF checkpoint not found: /nope/m.gguf",
        ),
    ],
)
def test_bad_config_is_rejected_before_workers(
    tmp_path: Path, tiny_assets: dict[str, str], overrides: list[str], expected: str
) -> None:
    cfg = write_config(tmp_path / "cfg.yaml", tiny_assets)
    args = [a for o in overrides for a in ("--set", o)]
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"), *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # nothing was started or written


def test_every_error_of_a_recipe_run_at_once_before_anything_is_built(tmp_path: Path) -> None:
    # Two typos: one a generic key (mode), one a backend option (rollout.*), one a component's
    # own option: all reported together, before the quickstart builds its model or the run
    # directory is made.
    run_dir = tmp_path / "run"
    proc = run_miles(
        "run",
        "quickstart",
        "--run-dir",
        str(run_dir),
        *("--set", "rollout.temperatur=0.8", "--set", "mode=asynch"),
        *("--set", "reward.answer_kee=x"),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    for expected in (
        "mode: 'asynch' is not one of",
        "rollout.temperatur: unknown key; did you mean 'temperature'?",
        "reward.answer_kee: unknown key; did you mean 'answer_key'?",
    ):
        assert expected in proc.stderr, proc.stderr
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


def test_unknown_recipe_or_missing_file(tmp_path: Path) -> None:
    proc = run_miles("run", "quickstar", timeout=60)
    assert proc.returncode != 0 and "did you mean 'quickstart'" in proc.stderr
    proc = run_miles("run", str(tmp_path / "nope.yaml"), timeout=60)
    assert proc.returncode != 0 and "config file not found" in proc.stderr


def test_a_hub_model_that_cannot_be_fetched_is_said_before_launch(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    """The audit: `miles run qwen3-0.6b-gsm8k-grpo` on a machine without the hub failed inside an
    actor with a connection error, after Ray started."""
    from miles.runtime.cluster.process import free_port

    cfg = write_config(tmp_path / "cfg.yaml", tiny_assets, model={"path": "Qwen/Qwen3-0.6B"})
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens
    }
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"), env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        "'Qwen/Qwen3-0.6B' is not a local checkpoint nor in the Hugging Face cache" in proc.stderr
    )
    assert "huggingface-cli download Qwen/Qwen3-0.6B" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
