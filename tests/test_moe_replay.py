"""MoE routing replay end to end: engines record every token's experts, the trainer replays
them, and the quickstart task learns on a tiny Qwen3-MoE with replay on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from .conftest import read_jsonl, run_miles, write_config
from .test_quickstart import learned

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def tied_moe(
    tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, str]
) -> dict[str, str]:
    """A tiny Qwen3-MoE whose router logits are near ties (expert rows pulled together)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles.recipes.families.routers import moe_routers
    from miles.torch.testing import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("moe") / "model", arch="qwen3_moe", seed=1)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for router in moe_routers(model):
            shared = router.weight.mean(dim=0, keepdim=True)
            router.weight.copy_(shared + 0.02 * (router.weight - shared))
    model.save_pretrained(path)
    return {**tiny_assets, "model": path}


def _step0(tmp_path: Path, assets: dict[str, str], replay: str) -> dict[str, Any]:
    cfg = write_config(
        tmp_path / f"{replay}.yaml",
        assets,
        steps=1,
        moe={"routing_replay": replay},
        # Rollout in bf16 on the paged path (routes recorded beside the K/V), training in fp32;
        # quickstart-moe below records on the hf path.
        rollout={"dtype": "bfloat16", "path": "paged", "page_size": 4},
        checkpoint={"at_end": False},
    )
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / replay))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return read_jsonl(tmp_path / replay / "metrics.jsonl")[0]


def test_replay_uses_the_recorded_experts_and_cuts_the_mismatch(
    tmp_path: Path, tied_moe: dict[str, str]
) -> None:
    off, ids = _step0(tmp_path, tied_moe, "off"), _step0(tmp_path, tied_moe, "ids")
    # Same seed, same engine: the two runs trained on the same rollout.
    assert off["rollout/reward_mean"] == ids["rollout/reward_mean"]
    # The trainer's own routers disagree with the rollout's on near-tied tokens either way (with
    # replay on, later layers see replayed hidden states, so the number moves a little).
    assert off["moe/routing_agreement"] < 1.0 and ids["moe/routing_agreement"] < 1.0
    assert ids["moe/replayed_match"] == 1.0 and "moe/replayed_match" not in off
    assert ids["moe/replayed_tokens"] > 0
    assert ids["train/rollout_logprob_abs_diff"] < off["train/rollout_logprob_abs_diff"]
    print(
        "\nbf16 rollout / fp32 train, step 0: agreement "
        f"{off['moe/routing_agreement']:.4f}; mean |logprob diff| off "
        f"{off['train/rollout_logprob_abs_diff']:.5f}, ids {ids['train/rollout_logprob_abs_diff']:.5f}"
    )


def test_replay_on_a_dense_model_is_refused_before_launch(
    tmp_path: Path, tiny_assets: dict[str, str]
) -> None:
    cfg = write_config(tmp_path / "cfg.yaml", tiny_assets, moe={"routing_replay": "ids"})
    proc = run_miles("run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=60)
    assert proc.returncode == 2
    assert "moe.routing_replay: model.path is a dense 'qwen3' model" in proc.stderr
    assert not (tmp_path / "run" / "events.jsonl").exists()  # nothing started


def test_quickstart_moe_learns_with_replay(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = run_miles(
        "run", "quickstart-moe", "--run-dir", str(run_dir), "--set", "telemetry.progress=false"
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert all(r["moe/replayed_match"] == 1.0 for r in steps)
    assert all(r["train/grad_norm"] < 1e3 for r in steps)  # stable: no blow-up
    assert learned(rows)
