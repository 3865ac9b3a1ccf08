"""What the `megatron` backend refuses before launch (its spec's `check`), each with the reason
and the fix. The run's own validation already refuses what the backend's capabilities leave out
(LoRA, a critic, context parallelism)."""

from __future__ import annotations

from typing import Any

from miles.core.config import RunConfig
from miles.megatron.config import MegatronConfig, schedule_problem

FSDP = "or train with train.backend: fsdp"


def megatron_run_checks(run: RunConfig, config: MegatronConfig) -> list[str]:
    problems: list[str] = []
    total = config.total_steps or run.steps + run.warmstart.steps
    if problem := schedule_problem(config, total):
        problems.append(problem)
    problems += _device_problems(run, config)
    problems += _precision_problems(run)
    if run.moe.routing_replay == "ids+weights":
        problems.append(
            "moe.routing_replay: the megatron backend replays the recorded experts (ids), not "
            f"their gate weights; use moe.routing_replay: ids, {FSDP}"
        )
    parallel = run.train.parallel
    if (
        config.activation_checkpointing
        and run.moe.routing_replay != "off"
        and parallel.pipeline > 1
    ):
        problems.append(
            "train.activation_checkpointing with moe.routing_replay at train.parallel.pipeline > 1: "
            "the 1F1B schedule recomputes a micro-batch after later ones have set their records; "
            "turn one of them off"
        )
    problems += _model_problems(run, config)
    return problems


def _device_problems(run: RunConfig, config: MegatronConfig) -> list[str]:
    if config.cpu_test_shims:
        return []
    why = "the megatron backend trains on CUDA GPUs (megatron-core is written for them)"
    if run.cluster.device == "cpu":
        return [f"train.backend: {why}, but cluster.device is cpu; {FSDP}"]
    if run.cluster.device == "auto" and not _local_cuda():
        return [
            f"train.backend: {why}, and this machine has none (torch finds no CUDA device); run "
            "it on a GPU machine, set cluster.device: cuda to drive a GPU cluster from here "
            f"(--ray-address), {FSDP}"
        ]
    return []


def _local_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _precision_problems(run: RunConfig) -> list[str]:
    from miles.core.contracts.components import Capability, Kind
    from miles.core.registry.plugins import get_plugin_manager

    name = run.precision.name
    try:
        spec = get_plugin_manager().get(Kind.PRECISION, name).spec
    except LookupError:
        return []  # the run's validation names an unknown precision
    if not spec.has(Capability.QUANTIZED):
        return []
    return [
        f"precision {name!r}: the megatron backend trains in bf16 (fp32 main weights) on "
        "megatron-core's local layers; fp8 and mxfp8 training need TransformerEngine, and "
        "quantization-aware training's layers are the fsdp backend's; use precision: bf16, "
        f"{FSDP}"
    ]


def _model_problems(run: RunConfig, config: MegatronConfig) -> list[str]:
    """The checkpoint's model against the layout, when its config.json is at hand (a local
    checkpoint, or a hub id whose family stores its config)."""
    from miles.core.contracts.family import text_config
    from miles.core.registry.families import model_config

    known = model_config(run.model.path) if run.model.path else None
    if known is None:
        return []  # a hub id no family knows: the trainer checks when it loads
    hf, family = known
    if family is None or family.megatron is None:
        return [f"model.path: {no_mapping(family, hf.get('model_type'))} ({FSDP})"]
    mapping = family.megatron(hf)
    if mapping.unsupported:
        return [
            f"model.path: megatron-core's GPTModel cannot express {family.name}'s "
            + "; ".join(mapping.unsupported)
            + f" ({FSDP})"
        ]
    return _layout_problems(run, config, mapping.transformer, text_config(hf))


def no_mapping(family: Any, model_type: Any) -> str:
    """Why the megatron backend cannot build a model: no family, or what the family's
    architecture has that megatron-core cannot express."""
    if family is None:
        return (
            f"no installed model family covers model_type {model_type!r}, so the megatron "
            "backend has no Megatron mapping for it"
        )
    missing = family.megatron_missing or "no Megatron mapping is declared for it yet"
    return f"the megatron backend cannot build model family {family.name!r}: {missing}"


def _layout_problems(run: RunConfig, config: MegatronConfig, t: Any, hf: Any) -> list[str]:
    p, problems = run.train.parallel, []
    layers, heads = int(t["num_layers"]), int(t["num_attention_heads"])
    groups = int(t.get("num_query_groups") or heads)
    experts = int(t.get("num_moe_experts") or 0)
    if layers % p.pipeline:
        problems.append(
            f"train.parallel.pipeline {p.pipeline} does not divide the model's {layers} layers"
        )
    for what, n in (("attention heads", heads), ("key/value heads", groups)):
        if n % p.tensor:
            problems.append(
                f"train.parallel.tensor {p.tensor} does not divide the model's {n} {what}"
            )
    if experts and experts % p.expert:
        problems.append(
            f"train.parallel.expert {p.expert} does not divide the model's {experts} experts"
        )
    if experts and p.tensor > 1:
        problems.append(
            "train.parallel.tensor > 1 with an MoE model: without sequence parallelism (which "
            "megatron-core builds only with TransformerEngine) every tensor rank routes every "
            "token, and the experts' gradients count each token once per tensor rank; use "
            "train.parallel.expert for the experts and tensor: 1"
        )
    tied = bool(hf.get("tie_word_embeddings", False))
    if tied and p.pipeline > 1 and config.cpu_test_shims:
        problems.append(
            "train.cpu_test_shims with tied embeddings at train.parallel.pipeline > 1: "
            "megatron-core sets up the last stage's copy of the embedding on CUDA only"
        )
    return problems
