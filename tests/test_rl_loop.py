"""The RL loop end to end through `miles run`: Ray actors, the torch engine, FSDP2, GRPO."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import read_jsonl, run_miles, write_config

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

REQUIRED_METRICS = {
    "step",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "train/loss",
    "train/ppo_kl",
    "train/grad_norm",
    "train/entropy",
    "train/rollout_logprob_abs_diff",
    "weights/version",
    "perf/step_s",
    "perf/rollout_s",
    "perf/train_s",
    "perf/sync_s",
    "perf/sync_gbps",
    "perf/sync_verify_s",
    "perf/tokens_per_s",
    # train-inference mismatch, logged every step
    "train/rollout_kl",
    "train/is_ratio_mean",
    "train/is_clipfrac",
    "train/ess_ratio",
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, str]) -> Path:
    """The tiny run, on the native engine's paged path (on CPU the other tests get the hf path
    by default): its logprobs must agree with training's, and a group's samples share their
    prompt's KV pages."""
    root = tmp_path_factory.mktemp("run")
    cfg = write_config(
        root / "cfg.yaml",
        tiny_assets,
        checkpoint={"every": 1, "keep_last": 2},
        rollout={"path": "paged", "page_size": 4},
    )
    run_dir = root / "run"
    proc = run_miles("run", str(cfg), "--run-dir", str(run_dir), "--set", "steps=3")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


def test_run_directory_contract(finished_run: Path) -> None:
    names = {p.name for p in finished_run.iterdir()}
    assert {
        "config.yaml",
        "manifest.json",
        "metrics.jsonl",
        "traces.jsonl",
        "events.jsonl",
        "checkpoints",
    } <= names
    rows = read_jsonl(finished_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]  # --set steps=3 took effect
    for row in rows:
        assert row.keys() >= REQUIRED_METRICS, REQUIRED_METRICS - row.keys()
    assert [r["weights/version"] for r in rows] == [1, 2, 3]
    # 4 samples per prompt: the last 3 of each group find its prompt's full pages cached.
    assert all(r["rollout/prefix_hit_rate"] > 0.3 for r in rows), rows


def test_step0_train_and_rollout_logprobs_agree(finished_run: Path) -> None:
    first = read_jsonl(finished_run / "metrics.jsonl")[0]
    assert first["train/rollout_logprob_abs_diff"] < 1e-4
    assert abs(first["train/ppo_kl"]) < 1e-5


def test_one_trace_spans_every_actor(finished_run: Path) -> None:
    spans = read_jsonl(finished_run / "traces.jsonl")
    assert len({s["trace_id"] for s in spans}) == 1
    names = {s["name"] for s in spans}
    assert {
        "miles.run",
        "miles.step",
        "miles.rollout",
        "miles.reward",
        "miles.generate",
        "miles.train_step",
        "miles.weight_sync",
        "miles.checkpoint",
    } <= names
    services = {s["resource"]["service.name"] for s in spans}
    assert {
        "miles.controller",
        "miles.rollout_manager",
        "miles.engine0",
        "miles.train0",
    } <= services
    by_id = {s["span_id"]: s for s in spans}
    # Actor spans hang under the controller's spans: context crossed the Ray calls.
    for span in spans:
        if span["name"] in ("miles.train_step", "miles.rollout", "miles.weight_sync.receive"):
            assert span["parent_span_id"] in by_id


def test_checkpoints_are_safetensors_and_json_only(finished_run: Path) -> None:
    ckpts = sorted(p.name for p in (finished_run / "checkpoints").iterdir())
    assert ckpts == ["step_2", "step_3"]  # keep: 2 pruned step_1
    files = [p for p in (finished_run / "checkpoints").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    allowed = {".safetensors", ".json", ".jinja", ".txt"}
    assert {p.suffix for p in files} <= allowed, {p.suffix for p in files} - allowed


def test_resume_continues_from_the_last_checkpoint(finished_run: Path, tmp_path: Path) -> None:
    import shutil

    run_dir = tmp_path / "resumed"
    shutil.copytree(finished_run, run_dir)
    proc = run_miles("run", "--resume", "--run-dir", str(run_dir), "--set", "steps=4")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["weights/version"] == 4


def _logprobs(model_dir: str | Path, tokens: Any) -> Any:
    """Each next token's logprob under the checkpoint at `model_dir`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=tokens).logits.float(), -1)
    return logp[:, :-1].gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_training_moves_the_policy(finished_run: Path, tiny_assets: dict[str, str]) -> None:
    import torch
    from safetensors.torch import load_file

    rows = read_jsonl(finished_run / "metrics.jsonl")
    assert all(r["train/grad_norm"] > 0 for r in rows)  # the reward gave a real signal
    assert any(r["rollout/reward_std"] > 0 for r in rows)
    # The optimizer really stepped: the last checkpoint's weights differ from the initial ones,
    # and the policy's logprobs on a fixed batch moved with them.
    trained = finished_run / "checkpoints" / "step_3" / "train"
    before = load_file(str(Path(tiny_assets["model"]) / "model.safetensors"))
    after = load_file(str(trained / "model.safetensors"))
    assert after.keys() == before.keys()
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(moved) > len(before) // 2, f"only {moved} changed"
    tokens = torch.randint(3, 128, (4, 24), generator=torch.Generator().manual_seed(0))
    shift = (_logprobs(trained, tokens) - _logprobs(tiny_assets["model"], tokens)).abs()
    assert shift.max() > 1e-3
