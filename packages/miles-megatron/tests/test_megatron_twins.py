"""Every model family with a Megatron mapping: its quickstart twin through the `megatron` backend
on a gloo CPU rank, against the native engine (megatron_twins_worker.py, one process for all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.core.contracts.components import Kind
from miles.core.registry.plugins import get_plugin_manager

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.timeout(600)

WORKER = Path(__file__).with_name("megatron_twins_worker.py")


def _families() -> list[str]:
    manager = get_plugin_manager()
    out = []
    for name in manager.registry.names(Kind.FAMILY):
        family = manager.get(Kind.FAMILY, name).spec.factory()
        if family.megatron is not None and family.tiny is not None:
            out.append(name)
    return out


FAMILIES = _families()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path_factory.mktemp("twins")), *FAMILIES],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {r["family"]: r for r in rows}


def test_the_mapped_families_are_the_ones_the_recipes_need() -> None:
    assert {"qwen3", "qwen3_moe", "deepseek_v3", "kimi_k25", "llama"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_twin_trains_through_megatron_and_syncs_to_the_engine(
    family: str, results: dict[str, dict]
) -> None:
    r = results[family]
    # The trainer's logprobs of the engine's tokens, before and after a step and a sync.
    assert max(r["diffs"]) < 1e-4, r
    assert r["grad_norm"] > 0 and r["moved"], r
    # The KL reference: the initial policy's logprobs, kept while the policy trains.
    assert r["ref_equal_at_start"] == 0.0 and r["ref_kept"] == 0.0, r
    assert r["policy_moved"] > 1e-3, r
    assert r["checksum_equal"] is True, r
    assert r["checkpoint_restored"] is True, r  # saved, trained on, loaded back
    if r["moe"]:
        for step in (0, 1):
            routing = r[f"routing_{step}"]
            assert routing["moe/replayed_tokens"] > 0, r
            assert routing["moe/replayed_match"] == 1.0, r
        # Replaying other experts than the engine's moves the logprobs: replay takes hold.
        assert r["shifted_diff"] > 1e-2, r
    else:
        assert r["routing_0"] == {}, r


@pytest.mark.parametrize("family", ["glm_moe_dsa", "deepseek_v4", "qwen3_5", "qwen3_5_moe"])
def test_a_family_without_a_mapping_is_refused_with_what_megatron_core_lacks(
    family: str, tmp_path: Path
) -> None:
    from miles.core.config import parse
    from miles.megatron.checks import megatron_run_checks
    from miles.megatron.config import MegatronConfig
    from miles.recipes.twins import twin_config_dict

    (tmp_path / "config.json").write_text(json.dumps(twin_config_dict(family)))
    run = parse({"model": {"path": str(tmp_path)}, "train": {"backend": "megatron"}})
    problems = megatron_run_checks(run, MegatronConfig(cpu_test_shims=True))
    missing = get_plugin_manager().get(Kind.FAMILY, family).spec.factory().megatron_missing
    assert missing, family
    assert any(missing in p and "train.backend: fsdp" in p for p in problems), problems


def test_what_the_backend_declares_it_cannot_do_is_refused_by_the_run(tmp_path: Path) -> None:
    """A critic, LoRA and context parallelism: not among the backend's capabilities, so the
    run's own validation refuses them before launch, each with its key."""
    from miles.core.config.tools import ConfigError
    from miles.runtime.runner import check_config

    data = {
        "model": {"path": str(tmp_path)},
        "train": {"backend": "megatron", "world_size": 2, "parallel": {"context": 2}},
        "algorithm": {"advantage": "gae"},
        "lora": {"rank": 8},
    }
    with pytest.raises(ConfigError) as refused:
        check_config(data)
    problems = refused.value.problems
    for key, capability in (
        ("train.parallel.context", "context_parallel"),
        ("algorithm.advantage", "critic"),
        ("lora", "lora"),
    ):
        assert any(
            p.startswith(f"{key}:") and f"train_backend 'megatron' cannot ({capability}" in p
            for p in problems
        ), (key, problems)
