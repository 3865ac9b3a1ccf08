"""Qwen3 (dense) and Qwen3-MoE."""

from miles.core.routing import ModelFamily
from miles.recipes.families.routers import SoftmaxTopKRouter


def qwen3() -> ModelFamily:
    return ModelFamily("qwen3", model_types=("qwen3",))


def qwen3_moe() -> ModelFamily:
    return ModelFamily("qwen3_moe", model_types=("qwen3_moe",), router=SoftmaxTopKRouter())
