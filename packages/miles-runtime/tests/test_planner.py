"""The memory planner's arithmetic, on a made-up family whose sizes are round numbers."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from miles.core.config import parse
from miles.core.contracts.components import Component, ComponentSpec, Kind
from miles.core.contracts.family import ModelFamily, ModelShape, ParallelHints, ParamCounts
from miles.core.contracts.memory import (
    PrecisionBytes,
    TrainBytes,
    TrainInputs,
    sharded_data_parallel,
)
from miles.core.registry import plugins
from miles.core.registry.plugins import PluginManager
from miles.runtime.planning.gpu_memory import MemoryParseError, parse_memory
from miles.runtime.planning.plan_table import format_plan
from miles.runtime.planning.planner import GB, PlanError, UnsizedModel, layout_of, plan, rescale

PARAMS = ParamCounts(embedding=1000, lm_head=1000, layers=6000, experts=8000, other=0)
SHAPE = ModelShape(
    params=PARAMS,
    num_layers=4,
    hidden_size=10,
    vocab_size=100,
    active_expert_params=2000,
    kv_elems_per_token=40,
    state_elems_per_seq=500,
    act_elems_per_token=400,
)
FAMILY = ModelFamily(
    "toy",
    model_types=("toy",),
    shape=lambda config: SHAPE,
    parallel=lambda config: ParallelHints(
        tensor_divides=(("num_attention_heads", 8),), expert_divides=(("num_experts", 16),)
    ),
)


@dataclass
class ShardedOptions:
    micro_batch_tokens: int = 8192
    activation_checkpointing: bool = False


def sharded_memory(inputs: TrainInputs, options: ShardedOptions) -> TrainBytes:
    return sharded_data_parallel(
        inputs,
        micro_batch_tokens=options.micro_batch_tokens,
        activation_checkpointing=options.activation_checkpointing,
        reference_copy=inputs.reference,
    )


def _spec(kind: Kind, name: str, factory: Any = None, **fields: Any) -> Component:
    spec = ComponentSpec(kind, name, factory or (lambda *a, **k: None), "test", **fields)
    return Component(spec, "test-plugins", "0")


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> PluginManager:
    """The process-wide plugins, as far as the planner sees them: the toy family, a sharded
    train backend declaring its memory model, and bf16; "megatron" and the rollout backends
    are not installed."""
    manager = PluginManager()
    for component in (
        _spec(Kind.FAMILY, "toy", factory=lambda: FAMILY),
        _spec(Kind.TRAIN_BACKEND, "sharded", config=ShardedOptions, memory=sharded_memory),
        _spec(Kind.PRECISION, "bf16", memory=lambda config: PrecisionBytes(2, 2)),
    ):
        manager.registry.add(component)
    monkeypatch.setattr(plugins, "_manager", manager)
    return manager


@pytest.fixture
def model(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return str(tmp_path)


def _run(model: str, **sections: Any) -> Any:
    data: dict[str, Any] = {
        "model": {"path": model},
        "data": {"path": "x.jsonl"},
        "rollout": {"prompts_per_step": 8, "samples_per_prompt": 4, "max_new_tokens": 100},
        "planner": {"prompt_tokens": 28},
        "train": {"backend": "sharded", "micro_batch_tokens": 50},
        "precision": "bf16",
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return parse(data)


def test_a_sharded_backend_shards_master_weights_grads_and_adam_over_every_rank(model: str) -> None:
    p = plan(_run(model, train={"world_size": 4}))
    total = PARAMS.language_model  # 16000
    biggest_layer = (PARAMS.layers + PARAMS.experts) / 4  # gathered whole, in bf16
    assert p.train.weights == pytest.approx(4 * total / 4 + 2 * biggest_layer)
    assert p.train.gradients == pytest.approx(4 * total / 4)
    assert p.train.optimizer == pytest.approx(8 * total / 4)
    # 50 tokens x 400 saved elements x 2 bytes, plus bf16 logits and 16 bytes of fp32 each.
    assert p.train.activations == pytest.approx(50 * 400 * 2 + 50 * 100 * 18)


def test_activation_checkpointing_keeps_only_layer_inputs(model: str) -> None:
    p = plan(_run(model, train={"activation_checkpointing": True}))
    per_layer = 400 / 4
    assert p.train.activations == pytest.approx(50 * (10 * 4 + per_layer) * 2 + 50 * 100 * 18)


def test_a_backend_not_installed_is_sized_model_parallel_and_said_so(model: str) -> None:
    run = _run(
        model,
        train={
            "backend": "megatron",
            "world_size": 16,
            "parallel": {"tensor": 2, "pipeline": 2, "expert": 4},
        },
    )
    p = plan(run)
    share = 6000 / (2 * 2) + 8000 / (2 * 4) + 1000 / 2  # stage layers + experts + vocab part
    assert p.train.weights == pytest.approx(2 * share)
    assert p.train.gradients == pytest.approx(4 * share)
    assert p.train.optimizer == pytest.approx(12 * share / 4)  # DP = 16 / (2 x 2)
    assert p.train.activations == pytest.approx((50 * 400 * 2 + 50 * 100 * 18) / 2)
    assert any("'megatron' is not installed here" in n for n in p.notes)
    assert any("rollout backend 'torch' is not installed here" in n for n in p.notes)


def test_rollout_kv_cache_is_sized_for_the_engine_concurrency(model: str) -> None:
    run = _run(model, rollout={"engines": 2, "gpus_per_engine": 2, "max_batch_size": 10})
    p = plan(run)
    concurrency = min(math.ceil(8 * 4 / 2), 10)
    assert p.rollout.kv_cache == pytest.approx(concurrency * (128 * 40 + 500) * 2 / 2)
    assert p.rollout.weights == pytest.approx(2 * 16000 / 2)
    # One layer's working set over the prompts it prefills (10 x 28 tokens).
    assert p.rollout.activations == pytest.approx(10 * 28 * (400 / 4) * 2 / 2)


def test_fits_against_gpu_memory_and_says_what_dominates(model: str) -> None:
    p = plan(_run(model), gpu_mem_gb=1.0)
    assert p.fits is True
    tight = plan(_run(model), gpu_mem_gb=100e3 / GB)
    assert tight.fits is False
    text = format_plan(tight)
    assert "DOES NOT FIT" in text and "rollout GPUs: most of it is the KV cache" in text
    assert plan(_run(model)).fits is None  # no memory given: nothing to check


def test_rescale_keeps_model_parallel_shapes_and_the_split(model: str) -> None:
    run = _run(
        model,
        train={"backend": "megatron", "world_size": 64, "parallel": {"tensor": 4, "pipeline": 2}},
        rollout={"engines": 8, "gpus_per_engine": 8},
    )
    layout = rescale(layout_of(run), 32)
    assert (layout.train_gpus, layout.engines, layout.tensor, layout.pipeline) == (16, 2, 4, 2)
    with pytest.raises(PlanError, match="at least 16"):
        rescale(layout_of(run), 12)


def test_layout_errors_name_the_model_dimension(model: str) -> None:
    run = _run(
        model,
        train={"backend": "megatron", "world_size": 6, "parallel": {"tensor": 3}},
        rollout={"gpus_per_engine": 3},
    )
    with pytest.raises(PlanError) as err:
        plan(run)
    assert "does not divide the model's num_attention_heads (8)" in str(err.value)


def test_an_unknown_model_cannot_be_sized(tmp_path: Path) -> None:
    with pytest.raises(UnsizedModel, match="no installed family knows"):
        plan(_run("org/unknown-model"))


@pytest.mark.parametrize(
    ("text", "gb"), [("141GB", 141.0), ("80 GiB", 80 * 2**30 / 1e9), ("96g", 96.0), ("40", 40.0)]
)
def test_parse_memory(text: str, gb: float) -> None:
    assert parse_memory(text) == pytest.approx(gb)
    with pytest.raises(MemoryParseError):
        parse_memory("lots")


@pytest.mark.parametrize(
    ("offload", "gpu_mem_gb", "offloads"),
    [
        ("auto", 1.0, False),  # trainer + engines fit together: both stay
        ("auto", 0.0002, True),  # they do not: they take turns
        ("auto", None, True),  # no GPU memory known: as always
        ("never", 0.0002, False),
        ("always", 1.0, True),
    ],
)
def test_a_colocated_hand_over_offloads_by_the_plan(
    model: str, offload: str, gpu_mem_gb: float | None, offloads: bool
) -> None:
    from miles.runtime.planning.planner import colocated_offload

    run = _run(model, placement="colocated", offload=offload)
    p = plan(run, gpu_mem_gb=gpu_mem_gb)
    assert p.offloads is offloads
    together = p.train_total + p.rollout_total
    assert p.peak == (max(p.train_total, p.rollout_total) if offloads else together)
    assert colocated_offload(run, gpu_mem_gb)[0] is offloads
    assert ("offloads (trainer and engines take turns" in format_plan(p)) is offloads
    assert not plan(_run(model, offload=offload), gpu_mem_gb=gpu_mem_gb).offloads  # apart
