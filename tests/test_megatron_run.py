"""`miles run` with `train.backend: megatron`: on a machine without CUDA it stops before launch
and says why (with every other refusal of the run), and with the CPU test shims the MoE
quickstart runs end to end through it (routing replay, weight sync, checkpoint and resume)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import read_jsonl, run_miles

pytest.importorskip("megatron.core")
torch = pytest.importorskip("torch")

SHORT = ("--set", "steps=2", "--set", "warmstart.steps=2", "--set", "eval.data=null")
SHIMS = ("--set", "train.backend=megatron", "--set", "train.cpu_test_shims=true")


# Only a machine without CUDA shows the no-CUDA refusal; on a GPU machine the backend would run
# (the GPU side is checked by the GPU runs in docs/benchmarks.md).
@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_what_the_megatron_backend_cannot_do_is_refused_before_launch(tmp_path: Path) -> None:
    proc = run_miles(
        "run", "quickstart-moe", "--run-dir", str(tmp_path / "run"),
        "--set", "train.backend=megatron", "--set", "precision=fp8",
        "--set", "train.world_size=2", "--set", "train.parallel.tensor=2",
        "--set", "moe.routing_replay=ids+weights",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())  # problems are wrapped over lines
    for problem in (
        "the megatron backend trains on CUDA GPUs",
        "this machine has none",
        "precision 'fp8': the megatron backend trains in bf16",
        "train.parallel.tensor > 1 with an MoE model",
        "moe.routing_replay: the megatron backend replays the recorded experts (ids)",
    ):
        assert problem in err, (problem, err[-3000:])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_backend_options_are_checked_when_the_config_is_read(tmp_path: Path) -> None:
    """bf16 on CPU ranks is refused with the fix (megatron-core's optimizer takes bf16 on CUDA
    only), and a bare YAML `off` (a boolean in YAML 1.1) is read as the word for `compile`."""
    proc = run_miles(
        "run", "quickstart", "--run-dir", str(tmp_path / "run"), *SHIMS,
        "--set", "train.dtype=bfloat16", "--set", "train.compile=off",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "dtype bfloat16 with cpu_test_shims" in err and "train.dtype: float32" in err, err
    assert "compile" not in err, err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(900)
def test_the_moe_quickstart_runs_through_megatron_on_cpu_ranks_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_miles(
        "run", "quickstart-moe", "--run-dir", str(run_dir), *SHORT, *SHIMS,
        "--set", "telemetry.progress=false", "--set", "telemetry.profile_steps=[1]",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        # The trainer's logprobs of the engine's tokens (fp32 on both sides), through replay.
        assert m["train/rollout_logprob_abs_diff"] < 1e-4, m
        assert m["moe/replayed_tokens"] > 0 and m["moe/replayed_match"] == 1.0, m
        assert m["train/grad_norm"] > 0, m
    # The step profile (`telemetry.profile_steps`) through the backend's profiler.
    assert (run_dir / "profiles" / "train0-step1.txt").is_file(), sorted(run_dir.iterdir())
    checkpoint = run_dir / "checkpoints" / "step_2" / "train"  # after the 2 steps
    assert (checkpoint / "model.safetensors").is_file(), sorted(run_dir.rglob("*"))[:20]
    resumed = run_miles(
        "run", "--resume", "--run-dir", str(run_dir), "--set", "steps=3",
        "--set", "telemetry.progress=false",
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
