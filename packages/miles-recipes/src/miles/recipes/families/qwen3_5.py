"""Qwen3.5 (dense) and Qwen3.5-MoE, and the Qwen3.6 checkpoints built on them.

The language model is a hybrid: most layers are Gated DeltaNet linear attention (a causal conv
over q/k/v, then a gated delta-rule recurrence: a fixed-size state per sequence, no KV cache),
every `full_attention_interval`-th layer is gated full attention (GQA with q/k RMSNorm, an output
gate from a doubled q projection, partial rotary). Dense checkpoints have a SwiGLU MLP per layer;
MoE checkpoints have, in every layer, a softmax top-k router that always renormalises its top-k,
routed experts, and a sigmoid-gated shared expert.

The released checkpoints are multimodal (`Qwen3_5[Moe]ForConditionalGeneration`: a vision tower
plus the language model, weights under `model.language_model.*`). transformers maps them to the
text causal LM (`Qwen3_5[Moe]ForCausalLM`) under AutoModelForCausalLM, renaming the weights and
skipping the vision tower and MTP weights, so no `load` is needed; the causal LM saves as a
`qwen3_5[_moe]_text` checkpoint that loads back by that model_type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from miles.core.contracts.family import (
    Config,
    ModelFamily,
    ModelShape,
    Notice,
    ParallelHints,
    ParamCounts,
)
from miles.recipes.families.qwen3 import aux_loss_notices, quantization_notices, with_defaults
from miles.recipes.families.routers import SoftmaxTopKRouter
from miles.recipes.families.sizing import embeddings, linear, moe_act, swiglu, swiglu_act

if TYPE_CHECKING:
    import torch

WRAPPER_TYPES = ("qwen3_5", "qwen3_5_moe")  # multimodal ...ForConditionalGeneration configs

# Defaults of transformers' Qwen3_5TextConfig / Qwen3_5MoeTextConfig / vision configs for the
# fields `shape` reads.
_TEXT_COMMON: dict[str, Any] = {
    "vocab_size": 248320,
    "num_attention_heads": 16,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "layer_types": None,
    "full_attention_interval": 4,  # popped by __post_init__ to build layer_types
}
TEXT_DEFAULTS: dict[str, Any] = {
    **_TEXT_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_key_value_heads": 4,
}
MOE_TEXT_DEFAULTS: dict[str, Any] = {
    **_TEXT_COMMON,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
    "router_aux_loss_coef": 0.001,
}
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
}


class RenormalizedSoftmaxRouter(SoftmaxTopKRouter):
    """Qwen3.5-MoE's router: softmax over all experts, top-k, always renormalised (the router
    has no `norm_topk_prob` switch, unlike Qwen3-MoE's)."""

    def gate_weights(
        self, router: Any, logits: torch.Tensor, indices: torch.Tensor
    ) -> torch.Tensor:
        import torch

        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
        return (weights / weights.sum(dim=-1, keepdim=True)).to(logits.dtype)


# What the megatron backend would need (the families declare no Megatron mapping).
QWEN3_5_MEGATRON_MISSING = (
    "Gated DeltaNet linear-attention layers (a causal convolution and a gated "
    "delta-rule recurrence) and full attention with an output gate, which "
    "megatron-core's GPTModel has no layers for"
)


def _is_wrapper(config: Config) -> bool:
    return config.get("model_type") in WRAPPER_TYPES


def _text(config: Config, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config with defaults (a wrapper without text_config gets all)."""
    raw = config.get("text_config") if _is_wrapper(config) else config
    return with_defaults(raw if isinstance(raw, Mapping) else {}, defaults)


def layer_types(c: Mapping[str, Any]) -> list[str]:
    interval = int(c["full_attention_interval"])
    return list(c["layer_types"] or []) or [
        "linear_attention" if (i + 1) % interval else "full_attention"
        for i in range(int(c["num_hidden_layers"]))
    ]


def _linear_dims(c: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(key dim, value dim, conv channels, value heads) of a Gated DeltaNet layer."""
    key = int(c["linear_key_head_dim"]) * int(c["linear_num_key_heads"])
    value = int(c["linear_value_head_dim"]) * int(c["linear_num_value_heads"])
    return key, value, 2 * key + value, int(c["linear_num_value_heads"])


def gated_delta_net_params(c: Mapping[str, Any]) -> int:
    hidden = int(c["hidden_size"])
    _, value, conv, v_heads = _linear_dims(c)
    return (
        linear(hidden, conv)  # in_proj_qkv
        + linear(hidden, value)  # in_proj_z (output gate)
        + 2 * linear(hidden, v_heads)  # in_proj_b (beta), in_proj_a (decay)
        + conv * int(c["linear_conv_kernel_dim"])  # depthwise conv1d, no bias
        + 2 * v_heads  # dt_bias, A_log
        + int(c["linear_value_head_dim"])  # gated RMSNorm over each value head
        + linear(value, hidden)  # out_proj
    )


def gated_delta_net_act(c: Mapping[str, Any]) -> int:
    """Per token: input, qkv projection and conv outputs, z, a/b, core output, normed output,
    output projection."""
    hidden = int(c["hidden_size"])
    _, value, conv, v_heads = _linear_dims(c)
    return hidden + 2 * conv + value + 2 * v_heads + 2 * value + hidden


def gated_attention_params(c: Mapping[str, Any]) -> int:
    """Full attention: q_proj doubled for the output gate, k/v, o, q/k RMSNorms."""
    hidden, bias = int(c["hidden_size"]), bool(c["attention_bias"])
    heads, kv, dim = int(c["num_attention_heads"]), int(c["num_key_value_heads"]), _head_dim(c)
    return (
        linear(hidden, 2 * heads * dim, bias)
        + 2 * linear(hidden, kv * dim, bias)
        + linear(heads * dim, hidden, bias)
        + 2 * dim
    )


def gated_attention_act(c: Mapping[str, Any]) -> int:
    """Per token: input, q+gate/k/v outputs, q/k after norm and rope, attention output, its
    gated version, output projection."""
    hidden, dim = int(c["hidden_size"]), _head_dim(c)
    q, kv = int(c["num_attention_heads"]) * dim, int(c["num_key_value_heads"]) * dim
    return hidden + (2 * q + 2 * kv) + (q + kv) + 2 * q + hidden


def _head_dim(c: Mapping[str, Any]) -> int:
    return int(c["head_dim"] or int(c["hidden_size"]) // int(c["num_attention_heads"]))


def vision_params(config: Config) -> int:
    """The wrapper's vision tower: patch embedding, learned positions, ViT blocks, merger."""
    if not _is_wrapper(config):
        return 0
    raw = config.get("vision_config")
    v = with_defaults(raw if isinstance(raw, Mapping) else {}, VISION_DEFAULTS)
    hidden, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    patch = int(v["in_channels"]) * int(v["temporal_patch_size"]) * int(v["patch_size"]) ** 2
    block = (
        2 * 2 * hidden  # two LayerNorms
        + linear(hidden, 3 * hidden, True)  # qkv
        + linear(hidden, hidden, True)  # proj
        + linear(hidden, inter, True)
        + linear(inter, hidden, True)
    )
    merged = hidden * int(v["spatial_merge_size"]) ** 2
    merger = (
        2 * hidden + linear(merged, merged, True) + linear(merged, int(v["out_hidden_size"]), True)
    )
    return (
        linear(patch, hidden, True)
        + int(v["num_position_embeddings"]) * hidden
        + int(v["depth"]) * block
        + merger
    )


def _state_per_linear_layer(c: Mapping[str, Any]) -> int:
    """What one sequence holds per Gated DeltaNet layer: the last kernel-1 conv inputs of every
    conv channel (what inference engines keep; transformers keeps kernel columns) and the
    [value heads, key dim, value dim] recurrent state."""
    _, _, conv, v_heads = _linear_dims(c)
    recurrent = v_heads * int(c["linear_key_head_dim"]) * int(c["linear_value_head_dim"])
    return conv * (int(c["linear_conv_kernel_dim"]) - 1) + recurrent


def _hybrid_shape(config: Config, moe: bool) -> ModelShape:
    c = _text(config, MOE_TEXT_DEFAULTS if moe else TEXT_DEFAULTS)
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    types = layer_types(c)
    n_full = sum(t == "full_attention" for t in types)
    n_linear = layers - n_full
    mixers = n_full * gated_attention_params(c) + n_linear * gated_delta_net_params(c)
    mixer_act = n_full * gated_attention_act(c) + n_linear * gated_delta_net_act(c)
    experts = active = 0
    if moe:
        n_exp, top_k = int(c["num_experts"]), int(c["num_experts_per_tok"])
        moe_inter, shared = (
            int(c["moe_intermediate_size"]),
            int(c["shared_expert_intermediate_size"]),
        )
        expert = swiglu(hidden, moe_inter)
        # router, shared expert and its sigmoid gate; every layer is MoE
        mlp = n_exp * hidden + swiglu(hidden, shared) + hidden
        mlp_act = moe_act(hidden, moe_inter, top_k, n_exp) + swiglu_act(hidden, shared) + 1
        experts, active = layers * n_exp * expert, layers * top_k * expert
    else:
        inter = int(c["intermediate_size"])
        mlp, mlp_act = swiglu(hidden, inter), swiglu_act(hidden, inter)
    # The lm_head Miles loads ties by the text config's tie_word_embeddings (the wrapper's own
    # flag only ties the wrapper; `notices` flags a checkpoint where the two disagree).
    embed, head = embeddings(c)
    return ModelShape(
        params=ParamCounts(
            embedding=embed,
            lm_head=head,
            layers=mixers + layers * (mlp + 2 * hidden),
            experts=experts,
            other=hidden,  # final norm
            vision=vision_params(config),
        ),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=int(c["vocab_size"]),
        active_expert_params=active,
        kv_elems_per_token=n_full * 2 * int(c["num_key_value_heads"]) * _head_dim(c),
        state_elems_per_seq=n_linear * _state_per_linear_layer(c),
        act_elems_per_token=mixer_act + layers * (2 * hidden + mlp_act),
    )


def qwen3_5_shape(config: Config) -> ModelShape:
    return _hybrid_shape(config, moe=False)


def qwen3_5_moe_shape(config: Config) -> ModelShape:
    return _hybrid_shape(config, moe=True)


def _parallel(config: Config, moe: bool) -> ParallelHints:
    c = _text(config, MOE_TEXT_DEFAULTS if moe else TEXT_DEFAULTS)
    tensor = [
        (name, int(c[name]))
        for name in (
            "num_attention_heads",
            "num_key_value_heads",
            "linear_num_key_heads",
            "linear_num_value_heads",
        )
    ]
    if moe:
        tensor += [
            ("moe_intermediate_size", int(c["moe_intermediate_size"])),
            ("shared_expert_intermediate_size", int(c["shared_expert_intermediate_size"])),
        ]
        return ParallelHints(tuple(tensor), (("num_experts", int(c["num_experts"])),))
    return ParallelHints((*tensor, ("intermediate_size", int(c["intermediate_size"]))))


def qwen3_5_parallel(config: Config) -> ParallelHints:
    return _parallel(config, moe=False)


def qwen3_5_moe_parallel(config: Config) -> ParallelHints:
    return _parallel(config, moe=True)


def _notices(config: Config, moe: bool) -> list[Notice]:
    c = _text(config, MOE_TEXT_DEFAULTS if moe else TEXT_DEFAULTS)
    out = quantization_notices(config) or quantization_notices(c)
    mtp = int(c.get("mtp_num_hidden_layers") or 0)
    if mtp > 0:
        out.append(
            Notice(
                f"multi-token prediction: the checkpoint has {mtp} MTP layer(s) (mtp.*), which "
                "transformers does not build: they are not loaded, not trained by RL, and a "
                "trained checkpoint is saved without them (engines cannot use them for "
                "speculative decoding afterwards)"
            )
        )
    if c.get("attn_output_gate") is False:
        out.append(
            Notice(
                "attn_output_gate: false, but transformers' Qwen3.5 attention always applies the "
                "output gate (its q_proj is doubled): the checkpoint would not load as written",
                fatal=True,
            )
        )
    if _is_wrapper(config):
        out.append(
            Notice(
                "multimodal checkpoint: Miles loads and trains the language model only; the "
                "vision encoder is not loaded or updated, prompts with images or video are not "
                "supported, and a trained checkpoint is saved as the text model "
                f"({config.get('model_type')}_text)"
            )
        )
        if config.get("tie_word_embeddings") and not c.get("tie_word_embeddings"):
            out.append(
                Notice(
                    "tie_word_embeddings is true for the multimodal model but not in text_config:"
                    " the text causal LM Miles loads would get a randomly initialised lm_head "
                    "(the checkpoint has none); set text_config.tie_word_embeddings: true",
                    fatal=True,
                )
            )
    if moe:
        if c.get("norm_topk_prob") is False:
            out.append(
                Notice(
                    "norm_topk_prob: false, but transformers' Qwen3.5-MoE router always "
                    "renormalises the top-k weights: the model would route differently",
                    fatal=True,
                )
            )
        if c.get("mlp_only_layers"):
            out.append(
                Notice(
                    "mlp_only_layers is set, but transformers' Qwen3.5-MoE makes every layer "
                    "MoE: the checkpoint's dense layers would not load",
                    fatal=True,
                )
            )
        out += aux_loss_notices(c)
    return out


def qwen3_5_notices(config: Config) -> list[Notice]:
    return _notices(config, moe=False)


def qwen3_5_moe_notices(config: Config) -> list[Notice]:
    return _notices(config, moe=True)


def _tiny_text() -> dict[str, Any]:
    return {
        "hidden_size": 64,
        "num_hidden_layers": 4,  # three Gated DeltaNet layers, then one full attention
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "attn_output_gate": True,
        "max_position_embeddings": 64,
        "initializer_range": 0.1,
        # As released: multimodal rope sections (interleaved), a quarter of each head rotated.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    }


def _tiny_vision() -> dict[str, Any]:
    return {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
    }


# The twins are the multimodal wrapper, as the released checkpoints are, so the text-model
# loading path is exercised. The image/video token ids keep their (out-of-vocabulary) defaults:
# no word of the twin's vocabulary is taken for an image placeholder.
def qwen3_5_tiny() -> dict[str, Any]:
    # Tied, like the small dense releases (both flags: see the tie notice).
    text = {"model_type": "qwen3_5_text", **_tiny_text(), "intermediate_size": 192}
    return {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "tie_word_embeddings": True,
        "text_config": {**text, "tie_word_embeddings": True},
        "vision_config": _tiny_vision(),
    }


def qwen3_5_moe_tiny() -> dict[str, Any]:
    text = {
        "model_type": "qwen3_5_moe_text",
        **_tiny_text(),
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32,
        "tie_word_embeddings": False,  # as every MoE release
    }
    return {
        "model_type": "qwen3_5_moe",
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": _tiny_vision(),
    }


def qwen3_5() -> ModelFamily:
    return ModelFamily(
        "qwen3_5",
        megatron_missing=QWEN3_5_MEGATRON_MISSING,
        model_types=("qwen3_5", "qwen3_5_text"),
        shape=qwen3_5_shape,
        parallel=qwen3_5_parallel,
        notices=qwen3_5_notices,
        tiny=qwen3_5_tiny,
        summary="Qwen3.5/3.6 dense: Gated DeltaNet + gated full attention (3:1), multimodal",
        checkpoints=("Qwen/Qwen3.5-27B", "Qwen/Qwen3.6-27B"),
    )


def qwen3_5_moe() -> ModelFamily:
    return ModelFamily(
        "qwen3_5_moe",
        megatron_missing=QWEN3_5_MEGATRON_MISSING,
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        router=RenormalizedSoftmaxRouter(),
        shape=qwen3_5_moe_shape,
        parallel=qwen3_5_moe_parallel,
        notices=qwen3_5_moe_notices,
        tiny=qwen3_5_moe_tiny,
        summary="Qwen3.5/3.6 MoE: Gated DeltaNet + gated attention, top-k + shared expert",
        checkpoints=("Qwen/Qwen3.5-397B-A17B", "Qwen/Qwen3.5-35B-A3B", "Qwen/Qwen3.6-35B-A3B"),
    )
