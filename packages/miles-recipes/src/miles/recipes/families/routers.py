"""Router adapters shared by the families: where the routers are, and how each kind of router
turns logits into gate weights for a given set of experts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only tensor methods run here: no torch import for the driver's family lookup
    import torch


def moe_routers(model: Any) -> list[Any]:
    """`layer.mlp.gate` of every decoder layer whose MLP is a mixture of experts."""
    text = getattr(model, "model", model)
    layers = getattr(text, "layers", None)
    if layers is None:  # a multimodal wrapper: the language model one level down
        layers = text.language_model.layers
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "experts")]


class SoftmaxTopKRouter:
    """Softmax over all experts, top-k, optionally renormalised (Qwen3-MoE, Qwen2-MoE, Mixtral
    style). Gate weights for other experts are the same softmax read at those experts."""

    def routers(self, model: Any) -> list[Any]:
        return moe_routers(model)

    def gate_weights(
        self, router: Any, logits: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        probs = logits.float().softmax(dim=-1)
        weights = probs.gather(-1, indices)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype)


class SigmoidGroupRouter:
    """DeepSeek-V3 style: sigmoid scores, group-limited top-k on bias-corrected scores, weights
    from the uncorrected scores, renormalised and scaled (DeepSeek-V3, Kimi K2/K2.5, GLM-4.5)."""

    def routers(self, model: Any) -> list[Any]:
        return moe_routers(model)

    def gate_weights(
        self, router: Any, logits: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        weights = logits.float().sigmoid().gather(-1, indices)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * float(getattr(router, "routed_scaling_factor", 1.0))
