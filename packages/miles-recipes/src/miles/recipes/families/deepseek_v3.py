"""DeepSeek-V3 and the models built on its architecture (Kimi K2 checkpoints load as it)."""

from miles.core.routing import ModelFamily
from miles.recipes.families.routers import SigmoidGroupRouter


def deepseek_v3() -> ModelFamily:
    return ModelFamily(
        "deepseek_v3", model_types=("deepseek_v3", "kimi_k2"), router=SigmoidGroupRouter()
    )
