"""Loading a Hugging Face checkpoint as the causal LM that Miles trains and serves.

Engines and trainers load through here, so both get the same module tree and weight names: the
checkpoint's model family may load it its own way (a multimodal checkpoint's language model), and
says at load time what it does not support. A pre-quantized checkpoint loads dequantized, for
every family: Miles trains and syncs full-precision weights.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoModelForCausalLM

from miles.core.family import dequantizing, loading_family


def load_causal_lm(model_path: str, **kwargs: Any) -> Any:
    """`from_pretrained(model_path, **kwargs)` of the causal LM, through the model's family."""
    family, config = loading_family(model_path)
    kwargs = dequantizing(config, kwargs)
    if family is not None and family.load is not None:
        return family.load(model_path, **kwargs)
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
