"""Kimi K2.5 / K2.6: a MoonViT vision tower and a patch-merger projector in front of a Kimi K2
(DeepSeek-V3 architecture) language model, as transformers' `Kimi_K25ForConditionalGeneration`.

Miles does text-only RL on the language model: `load` builds the `DeepseekV3ForCausalLM` of the
checkpoint's text_config and fills it from the checkpoint's language-model weights, renamed
(AutoModelForCausalLM has no mapping for kimi_k25). The vision weights stay on disk. A checkpoint
Miles saves is a plain deepseek_v3 causal LM.

The released checkpoints store their routed experts as compressed-tensors INT4 (pack-quantized,
group 32, symmetric; attention, shared experts, the dense MLP and lm_head are bf16), which
transformers can dequantize only through the compressed-tensors package: see the notices.
"""

from __future__ import annotations

import copy
from typing import Any

from miles.core.contracts.family import Config, ModelFamily, ModelShape, Notice, ParallelHints
from miles.recipes.families import deepseek_v3 as ds
from miles.recipes.families.sizing import linear

# Kimi_K25VisionConfig / Kimi_K25Config defaults (transformers 5.x). The released config.json
# spells its vision fields the remote-code way (vt_hidden_size, init_pos_emb_height...), which
# transformers' config does not read: it builds these defaults, which are the released values.
VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "patch_size": 14,
    "pos_emb_height": 64,
    "pos_emb_width": 64,
    "merge_kernel_size": (2, 2),
}
WRAPPER_DEFAULTS: dict[str, Any] = {"projection_hidden_size": 1152, "tie_word_embeddings": True}

# Checkpoint key -> causal LM key. The released layout is `language_model.model.layers.*` and
# `language_model.lm_head.*`; transformers 5.x saves a Kimi_K25ForConditionalGeneration the same
# way except that its vision tower's blocks->layers renaming, reversed, also turns the language
# model's `layers` into `blocks`. `model.language_model.*` is the wrapper's in-memory naming.
KEY_MAPPING: dict[str, str] = {
    r"^language_model\.model\.blocks\.": "model.layers.",
    r"^language_model\.model\.": "model.",
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",
}


def text_config(config: Config) -> Config:
    """The language model's config dict; without one transformers builds DeepSeek-V3's
    defaults."""
    return config.get("text_config") or {}


def _wrapper(config: Config, name: str) -> Any:
    return config.get(name, WRAPPER_DEFAULTS[name])


def tied(config: Config) -> bool:
    """The wrapper's tie_word_embeddings (default True) decides whether lm_head is the embedding;
    the text_config's own flag is ignored by the wrapper, and `load` follows the wrapper."""
    return bool(_wrapper(config, "tie_word_embeddings"))


def vision_params(config: Config) -> int:
    """MoonViT (patch conv, learned 2D position grid, pre-norm blocks with biased q/k/v/o and a
    GELU MLP, final LayerNorm) and the projector (LayerNorm, Linear, GELU, Linear to the text
    width over merge_kernel_size patches concatenated)."""
    v = {**VISION_DEFAULTS, **(config.get("vision_config") or {})}
    hidden, inter = int(v["hidden_size"]), int(v["intermediate_size"])
    patch = v["patch_size"]  # an int, or (height, width)
    ph, pw = (int(patch), int(patch)) if isinstance(patch, int) else (int(p) for p in patch)
    block = 2 * 2 * hidden + 4 * linear(hidden, hidden, True)
    block += linear(hidden, inter, True) + linear(inter, hidden, True)
    tower = (
        linear(3 * ph * pw, hidden, True)  # the patch Conv2d
        + int(v["pos_emb_height"]) * int(v["pos_emb_width"]) * hidden
        + int(v["num_hidden_layers"]) * block
        + 2 * hidden
    )
    kh, kw = (int(k) for k in v["merge_kernel_size"])
    merged = hidden * kh * kw
    text_hidden = int(text_config(config).get("hidden_size", ds.DEFAULTS["hidden_size"]))
    projector = (
        2 * int(_wrapper(config, "projection_hidden_size"))
        + linear(merged, merged, True)
        + linear(merged, text_hidden, True)
    )
    return tower + projector


def shape(config: Config) -> ModelShape:
    return ds.text_shape(text_config(config), tied=tied(config), vision=vision_params(config))


def parallel(config: Config) -> ParallelHints:
    return ds.text_parallel(text_config(config))


def notices(config: Config) -> list[Notice]:
    vision = Notice(
        f"the vision tower and projector ({vision_params(config):,} parameters) are not loaded: "
        "Miles trains the language model on text only; image and video inputs are not "
        "supported (media placeholder tokens are embedded as plain tokens)"
    )
    return ds.quantization_notices(config) + ds.text_notices(text_config(config)) + [vision]


def causal_lm_config(config: Any) -> Any:
    """The DeepseekV3Config of a Kimi_K25Config's language model, as Miles loads it: lm_head tied
    as the wrapper ties it, and the wrapper's quantization_config if the text model has none."""
    text = copy.deepcopy(config.text_config)
    text.tie_word_embeddings = bool(config.tie_word_embeddings)
    text.architectures = ["DeepseekV3ForCausalLM"]
    quant = getattr(config, "quantization_config", None)
    if getattr(text, "quantization_config", None) is None and quant is not None:
        text.quantization_config = quant
    return text


def load(path: str, **kwargs: Any) -> Any:
    """The checkpoint's language model as a DeepseekV3ForCausalLM, every weight from the
    checkpoint (dequantized if it is quantized); the vision weights are left unread."""
    from transformers import AutoConfig

    config = kwargs.pop("config", None) or AutoConfig.from_pretrained(path)
    if getattr(config, "model_type", None) == "kimi_k25":
        config = causal_lm_config(config)
    return ds.load_text_model(path, config, KEY_MAPPING, **kwargs)


def tiny() -> dict[str, Any]:
    """The wrapper class with a one-block vision tower, over a three-layer Kimi K2 (one dense
    layer, two MoE layers; low-rank query, MLA, one expert group as in K2, a shared expert,
    YaRN rope). The image/video token ids keep their defaults, outside the twin's vocabulary."""
    text = {
        **ds.tiny(),
        "model_type": "kimi_k2",  # as the released config.json says; transformers maps it
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "rope_parameters": {**ds.tiny()["rope_parameters"], "rope_theta": 50000.0},
    }
    return {
        "model_type": "kimi_k25",
        "architectures": ["Kimi_K25ForConditionalGeneration"],
        "tie_word_embeddings": False,
        "projection_hidden_size": 32,
        "text_config": text,
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "patch_size": 14,
            "pos_emb_height": 4,
            "pos_emb_width": 4,
            "merge_kernel_size": [2, 2],
        },
    }


def kimi_k25() -> ModelFamily:
    from miles.recipes.families.routers import SigmoidGroupRouter  # imports torch

    return ModelFamily(
        "kimi_k25",
        model_types=("kimi_k25",),
        router=SigmoidGroupRouter(),
        shape=shape,
        parallel=parallel,
        notices=notices,
        tiny=tiny,
        load=load,
        packed_sequences=True,
        rms_norms=("DeepseekV3RMSNorm",),
        summary="Kimi K2.5 / K2.6: MoonViT + projector over a Kimi K2 (DeepSeek-V3) language "
        "model; Miles loads and trains the language model only",
        checkpoints=("moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2.6"),
        # The language model Miles loads is a DeepseekV3ForCausalLM under DeepSeek-V3's names.
        megatron=ds.megatron,
    )
