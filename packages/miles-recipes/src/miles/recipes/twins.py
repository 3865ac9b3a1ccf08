"""Tiny twins: a family's architecture with tiny dimensions and random weights, written as a
Hugging Face checkpoint that loads through the same code as the real one.

`write_twin("deepseek_v4", path)` builds the architecture class the family's `tiny()` config
names (a multimodal wrapper stays a wrapper, so its loading path is exercised too), initialises it
from `seed`, and saves config.json, model.safetensors, generation_config.json and the quickstart
word-level tokenizer (ChatML template). No hub access is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from miles.core.contracts.family import ModelFamily
from miles.core.registry.families import family_named
from miles.recipes.words import IM_END, PAD, build_tokenizer, vocabulary


def resolve_family(family: ModelFamily | str) -> ModelFamily:
    return family if isinstance(family, ModelFamily) else family_named(family)


def twin_config_dict(family: ModelFamily | str, **overrides: Any) -> dict[str, Any]:
    """The twin's config.json fields: the family's tiny config, the quickstart vocabulary and
    its special tokens, then `overrides` (applied to the text model's fields)."""
    fam = resolve_family(family)
    if fam.tiny is None:
        raise ValueError(f"family {fam.name!r} has no tiny twin")
    config = dict(fam.tiny())
    vocab = vocabulary()
    tokens = {
        "vocab_size": len(vocab),
        "pad_token_id": vocab.index(PAD),
        "eos_token_id": vocab.index(IM_END),
        "bos_token_id": None,
    }
    if isinstance(config.get("text_config"), dict):
        config["text_config"] = {**config["text_config"], **tokens, **overrides}
        config.update({k: v for k, v in tokens.items() if k != "vocab_size"})
    else:
        config.update({**tokens, **overrides})
    return config


def build_twin_model(
    config_dict: dict[str, Any], seed: int, family: ModelFamily | None = None
) -> Any:
    """The twin's transformers model (random weights from `seed`; the global RNG is left as it
    was), finished by the family's `tiny_init`."""
    fields = dict(config_dict)
    architectures = fields.pop("architectures", None)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if architectures:
            config.architectures = list(architectures)
            model = getattr(transformers, architectures[0])(config)
        else:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # nn.Embedding zeroes the padding row at init; a trained checkpoint's is not zero. A
        # random twin that samples the pad token would otherwise feed an all-zero input.
        embeddings = model.get_input_embeddings()
        pad = getattr(embeddings, "padding_idx", None)
        if pad is not None:
            with torch.no_grad():
                embeddings.weight[pad].normal_(
                    0.0, float(config.get_text_config().initializer_range)
                )
        if family is not None and family.tiny_init is not None:
            family.tiny_init(model)
    return model.float()


def write_twin(
    family: ModelFamily | str, out_dir: str | Path, *, seed: int = 0, **overrides: Any
) -> str:
    """Writes the family's tiny twin to `out_dir`; returns the path. Equal arguments give
    bitwise-equal weights. `overrides` replace (text) config fields, e.g. num_hidden_layers=3."""
    fam = resolve_family(family)
    fields = twin_config_dict(fam, **overrides)
    model = build_twin_model(fields, seed, fam)
    text = fields.get("text_config", fields)
    model.generation_config = GenerationConfig(
        eos_token_id=text["eos_token_id"], pad_token_id=text["pad_token_id"]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    build_tokenizer(out)
    return str(out)
