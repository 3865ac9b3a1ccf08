"""miles-recipes' plugin module: the components it registers."""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import ComponentSpec, Kind, hookimpl, lazy
from miles.recipes.quickstart import quickstart, quickstart_moe


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
    ]


@hookimpl
def miles_register_families() -> Iterable[ComponentSpec]:
    return [
        # Lazy: the router adapters import torch, and listing plugins must not.
        ComponentSpec(
            Kind.FAMILY, "qwen3", lazy("miles.recipes.families.qwen3:qwen3"), "Qwen3 (dense)"
        ),
        ComponentSpec(
            Kind.FAMILY,
            "qwen3_moe",
            lazy("miles.recipes.families.qwen3:qwen3_moe"),
            "Qwen3-MoE: softmax top-k router",
        ),
        ComponentSpec(
            Kind.FAMILY,
            "deepseek_v3",
            lazy("miles.recipes.families.deepseek_v3:deepseek_v3"),
            "DeepSeek-V3 / Kimi K2: sigmoid, group-limited top-k router",
        ),
    ]
