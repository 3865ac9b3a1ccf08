"""miles-recipes' plugin module: the components it registers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from miles.core import ComponentSpec, Kind, hookimpl, lazy
from miles.recipes import catalog
from miles.recipes.quickstart import quickstart, quickstart_moe
from miles.recipes.smollm2 import smollm2_arithmetic_cpu, smollm2_arithmetic_grpo


@hookimpl
def miles_register_recipes() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.RECIPE,
            "quickstart",
            quickstart,
            "tiny Qwen3 learns 'say the largest number' by GRPO on a 2-core CPU in minutes",
        ),
        ComponentSpec(
            Kind.RECIPE,
            "quickstart-moe",
            quickstart_moe,
            "the quickstart task on a tiny Qwen3-MoE, with MoE routing replay (moe.routing_replay)",
        ),
        ComponentSpec(
            Kind.RECIPE,
            "smollm2-arithmetic-grpo",
            smollm2_arithmetic_grpo,
            "SmolLM2-135M-Instruct (GGUF from PyPI) learns two-digit arithmetic by GRPO, one GPU",
        ),
        ComponentSpec(
            Kind.RECIPE,
            "smollm2-arithmetic-cpu",
            smollm2_arithmetic_cpu,
            "the smollm2-arithmetic-grpo task sized for a laptop CPU (smaller batches, fp32)",
        ),
        *catalog.specs(),
    ]


# name, factory, summary. Lazy: the router adapters import torch, and listing plugins must not.
FAMILIES = [
    ("llama", "llama:llama", "Llama / SmolLM2 (dense)"),
    ("qwen3", "qwen3:qwen3", "Qwen3 (dense)"),
    ("qwen3_moe", "qwen3:qwen3_moe", "Qwen3-MoE: softmax top-k router"),
    ("qwen3_5", "qwen3_5:qwen3_5", "Qwen3.5 / Qwen3.6 dense: Gated DeltaNet + full attention"),
    ("qwen3_5_moe", "qwen3_5:qwen3_5_moe", "Qwen3.5 / Qwen3.6 MoE: Gated DeltaNet hybrid, top-k"),
    ("deepseek_v3", "deepseek_v3:deepseek_v3", "DeepSeek-V3 / Kimi K2: MLA, sigmoid group router"),
    ("deepseek_v4", "deepseek_v4:deepseek_v4", "DeepSeek-V4: compressed sparse attention, mHC"),
    ("kimi_k25", "kimi_k25:kimi_k25", "Kimi K2.5 / K2.6: the language model of the VLM"),
    ("glm_moe_dsa", "glm5:glm_moe_dsa", "GLM-5 / GLM-5.1: MLA + DSA indexer, sigmoid router"),
]


def _with_architectures(target: str) -> Callable[[], Any]:
    """The family factory at `target`, knowing the stored config.json of its checkpoints (so a
    plan of a hub id needs no download)."""
    factory = lazy(f"miles.recipes.families.{target}")

    def family() -> Any:
        from miles.recipes import architectures

        return dataclasses.replace(factory(), config_for=architectures.config_for)

    family.__name__ = family.__qualname__ = factory.__name__
    return family


@hookimpl
def miles_register_families() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(Kind.FAMILY, name, _with_architectures(target), summary)
        for name, target, summary in FAMILIES
    ]
