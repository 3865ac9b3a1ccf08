"""The Llama family against transformers: exact parameter counts on SmolLM2-135M's config and the
tiny twin, the twin loading as the causal LM Miles trains, the planner's shape of SmolLM2, and a
packed micro-batch of the twin giving the padded logprobs (the family declares packing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from miles.recipes.architectures import config_for
from miles.recipes.families.llama import llama
from miles.recipes.twins import twin_config_dict, write_twin

AUTO_LM: Any = AutoModelForCausalLM


def _meta_count(config: dict[str, Any]) -> int:
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        model = AUTO_LM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("source", ["smollm2", "twin"])
def test_shape_matches_transformers(source: str) -> None:
    family = llama()
    config = (
        config_for("HuggingFaceTB/SmolLM2-135M-Instruct")
        if source == "smollm2"
        else twin_config_dict(family)
    )
    assert config is not None and family.shape is not None
    shape = family.shape(config)
    assert shape.params.total == _meta_count(config)
    if source == "smollm2":
        assert shape.params.total == 134_515_008  # what the dequantised GGUF model holds
        assert shape.kv_elems_per_token == 30 * 2 * 3 * 64


def test_untied_head_and_biases_count() -> None:
    config = {**twin_config_dict(llama()), "tie_word_embeddings": False}
    config.update(attention_bias=True, mlp_bias=True, head_dim=None, num_key_value_heads=None)
    assert llama().shape(config).params.total == _meta_count(config)  # type: ignore[misc]


def test_twin_loads_as_the_causal_lm(tmp_path: Path) -> None:
    from miles.torch.models import load_causal_lm

    path = write_twin("llama", tmp_path / "twin")
    model = load_causal_lm(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert llama().shape(twin_config_dict(llama())).params.total == sum(  # type: ignore[misc]
        p.numel() for p in model.parameters()
    )
