"""Loading a Hugging Face checkpoint as the causal LM (and tokenizer) that Miles trains and serves.

Engines and trainers load through here, so both get the same module tree and weight names: the
checkpoint's model family may load it its own way (a multimodal checkpoint's language model), and
says at load time what it does not support. A pre-quantized checkpoint loads dequantized, for
every family: Miles trains and syncs full-precision weights.
"""

from __future__ import annotations

from typing import Any

import structlog
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from miles.core.contracts.family import Config, ModelFamily, quantization_config
from miles.core.registry.families import family_of_config, read_config
from miles.torch.gguf import converted_checkpoint, is_gguf

log = structlog.get_logger(__name__)


def load_causal_lm(model_path: str, **kwargs: Any) -> Any:
    """`from_pretrained(model_path, **kwargs)` of the causal LM, through the model's family. A
    .gguf file loads as its converted checkpoint (`miles.torch.gguf`)."""
    model_path = local_checkpoint(model_path)
    family, config = loading_family(model_path)
    kwargs = dequantizing(config, kwargs)
    if family is not None and family.load is not None:
        return family.load(model_path, **kwargs)
    return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)


def load_tokenizer(model_path: str) -> Any:
    """The checkpoint's tokenizer; when it ships no chat template, its family's."""
    model_path = local_checkpoint(model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if getattr(tokenizer, "chat_template", None) is None:
        config = read_config(model_path)
        family = family_of_config(config) if config is not None else None
        if family is not None and family.chat_template is not None:
            tokenizer.chat_template = family.chat_template
    return tokenizer


def local_checkpoint(model_path: str) -> str:
    """`model_path`, or for a .gguf file its converted checkpoint directory."""
    return str(converted_checkpoint(model_path)) if is_gguf(model_path) else model_path


def loading_family(model_path: str) -> tuple[ModelFamily | None, dict[str, Any] | None]:
    """(family, config.json) for loading `model_path` (a local checkpoint; a hub id gets its
    config through transformers), after checking the family's notices: a fatal one raises
    ValueError, the others are logged once per process."""
    config = read_config(model_path)
    if config is None:
        try:
            config = AutoConfig.from_pretrained(model_path).to_dict()
        except (OSError, ValueError):
            return None, None
    family = family_of_config(config)
    if family is None:
        return None, config
    for notice in family.notices(config):
        if notice.fatal:
            raise ValueError(f"model family {family.name!r}: {notice.message}")
        _say_once(family.name, notice.message)
    return family, config


def dequantizing(config: Config | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained kwargs that load a pre-quantized checkpoint (fp8 blocks, compressed-tensors)
    as plain weights. Miles trains and syncs full-precision weights; on a GPU that can run the
    format, transformers would otherwise build quantized modules that cannot be trained. A
    quantization_config the caller passed stays; families' notices say what a format needs."""
    quant = quantization_config(config) if config is not None else None
    if quant is None or quant.get("dequantize") or "quantization_config" in kwargs:
        return kwargs
    method = quant.get("quant_method")
    # Imported here: loading the quantization integrations costs about a second of start-up,
    # which only pre-quantized checkpoints need.
    if method == "fp8":
        from transformers import FineGrainedFP8Config

        return {**kwargs, "quantization_config": FineGrainedFP8Config(dequantize=True)}
    if method == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        return {**kwargs, "quantization_config": CompressedTensorsConfig(dequantize=True)}
    return kwargs


_said: set[str] = set()


def _say_once(family: str, message: str) -> None:
    if message not in _said:
        _said.add(message)
        log.warning("model family notice", family=family, notice=message)
