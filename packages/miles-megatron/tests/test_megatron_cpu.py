"""Megatron-core's own GPTModel, built and filled by miles.megatron on CPU ranks, against
transformers' forward of the same weights (see megatron_cpu_forward.py for how it runs on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

pytest.importorskip("megatron.core")

SCRIPT = Path(__file__).with_name("megatron_cpu_forward.py")


def _run(*cases: tuple[str, ...]) -> list[list[dict]]:
    """Each case's results, one per rank. The cases (of one world size) run one after another in
    the same ranks: one start-up of torch, megatron-core and transformers per rank for all."""
    args = [word for i, case in enumerate(cases) for word in (*(["+"] if i else []), *case)]
    env = {**os.environ, "MILES_TEST_PORT": str(29600 + os.getpid() % 300)}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ranks = [json.loads(line)["cases"] for line in out.stdout.splitlines() if line.startswith("{")]
    return [[rank[i] for rank in ranks] for i in range(len(cases))]


def _world(case: tuple[str, ...]) -> int:
    return int(case[1]) * int(case[2]) * int(case[3])


# (ranks and config, whether gradients are compared too). Gradients are compared where the
# training step's are exactly transformers' (see docs/megatron.md for the layouts that are not).
CASES = [
    (("qwen3", "2", "1", "1"), True),  # dense, tied embeddings, TP=2
    (("qwen3_moe", "1", "1", "1"), True),  # renormalised top-k
    # EP=2; softmax over all experts (no renormalisation); untied head.
    (("qwen3_moe", "1", "2", "1", "norm_topk_prob=false", "tie_word_embeddings=false"), False),
    # Multi-latent attention with YaRN, sigmoid group-limited routing, shared experts.
    (("deepseek_v3", "1", "1", "1"), True),
    (("llama", "2", "1", "1"), True),  # no q/k norms, tied embeddings, TP=2
]


# Pipeline stages: names and shapes only (a forward needs Megatron's schedule). Untied:
# Megatron's tied output layer on the last stage is set up on CUDA only.
PIPELINE = ("qwen3_moe", "1", "1", "2", "tie_word_embeddings=false")


@pytest.fixture(scope="module")
def cpu_results() -> dict[tuple[str, ...], list[dict]]:
    """Every CPU case's per-rank results, the cases of each world size in one launch."""
    cases = [args for args, _ in CASES] + [PIPELINE]
    results: dict[tuple[str, ...], list[dict]] = {}
    for world in sorted({_world(c) for c in cases}):
        group = [c for c in cases if _world(c) == world]
        results.update(zip(group, _run(*group), strict=True))
    return results


@pytest.mark.parametrize(("args", "grads"), CASES, ids=["-".join(a) for a, _ in CASES])
def test_megatron_logits_equal_transformers(
    args: tuple[str, ...], grads: bool, cpu_results: dict[tuple[str, ...], list[dict]]
) -> None:
    results = cpu_results[args]
    assert len(results) == int(args[1]) * int(args[2])
    for r in results:
        assert r["names_equal"], r["name_diff"]
        assert r["shapes_equal"]
        scale = max(1.0, r["ref_scale"])
        assert r["max_abs_diff"] < 1e-4 * scale, r
        assert r["packed_max_abs_diff"] < 1e-4 * scale, r
        # Logprobs and entropy from the hidden states (vocabulary-parallel head).
        assert r["logprob_max_abs_diff"] < 1e-4 and r["entropy_max_abs_diff"] < 1e-4, r
        if grads:
            assert r["grad_max_abs_diff"] < 1e-4 * max(1.0, r["grad_scale"]), r


def test_pipeline_stages_hold_the_parameters_megatron_builds(
    cpu_results: dict[tuple[str, ...], list[dict]],
) -> None:
    results = cpu_results[PIPELINE]
    assert len(results) == 2
    for r in results:
        assert r["names_equal"] and r["shapes_equal"], r


@pytest.mark.gpu
@pytest.mark.parametrize(
    "args",
    [
        ("qwen3", "1", "1", "1"),
        ("qwen3_moe", "1", "1", "1"),
        ("qwen3@Qwen/Qwen3-0.6B", "1", "1", "1"),
    ],
)
def test_megatron_logits_equal_transformers_in_bf16_on_a_gpu(
    args: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CUDA in bf16 the packed path is torch's variable-length FlashAttention.
    monkeypatch.setenv("MILES_MEGATRON_DEVICE", "cuda")
    monkeypatch.setenv("MILES_MEGATRON_DTYPE", "bfloat16")
    ((r,),) = _run(args)
    print(r)
    assert r["names_equal"] and r["shapes_equal"], r
    # bf16 against bf16 through different kernels: a few bf16 ulps of the logits' scale.
    for key in ("max_abs_diff", "packed_max_abs_diff"):
        assert r[key] < 0.05 * max(1.0, r["ref_scale"]), r


def test_a_model_megatron_cannot_express_is_refused_before_it_is_built() -> None:
    from miles.megatron.layout import ParallelLayout
    from miles.megatron.model import UnsupportedModel, transformer_config
    from miles.recipes.families.qwen3 import qwen3_megatron, qwen3_tiny

    sliding = {**qwen3_tiny(), "vocab_size": 300, "use_sliding_window": True}
    with pytest.raises(UnsupportedModel, match=r"sliding-window.*train\.backend: fsdp"):
        transformer_config(qwen3_megatron(sliding), ParallelLayout())


def _json_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("{")]
