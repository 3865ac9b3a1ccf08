"""Model families: what Miles needs to know about a transformers architecture beyond its weights.

A family (component kind `family`, found by the checkpoint's `model_type`) covers:
- **loading**: which causal LM a checkpoint becomes, and under which weight names (a multimodal
  checkpoint's language model, for instance);
- **MoE routers**, for routing replay (`router`);
- **the chat template** to use when a checkpoint's tokenizer ships none;
- **shape**: exact parameter counts, KV-cache and activation sizes, for the memory planner;
- **parallelism hints**: which dimensions tensor and expert parallelism must divide;
- **what is not supported** for a given config, said at load time (`notices`);
- **a tiny twin**: the same architecture with tiny dimensions, for tests and laptops.

Everything here works on a checkpoint's `config.json` as a plain dict, so it is torch-free:
`miles recipes plan` sizes a trillion-parameter model without building it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles.core.routing import RouterAdapter

Config = Mapping[str, Any]  # a config.json, as loaded by json.load


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by how parallelism shards them. `total` equals what transformers counts."""

    embedding: int  # input embeddings (vocab-parallel under TP; first pipeline stage)
    lm_head: int  # output projection, 0 when tied to the embeddings (last pipeline stage)
    layers: int  # every decoder layer except its routed experts: attention, dense MLPs, shared
    # experts, routers, norms, indexers... (TP-sharded, split over pipeline stages)
    experts: int = 0  # routed experts of every MoE layer (EP-sharded, split over stages)
    other: int = 0  # outside the layers besides embeddings and head (final norm, heads...)
    # A multimodal checkpoint's vision encoder and projector. Miles does text-only RL: they are in
    # the checkpoint but not loaded, trained or synced.
    vision: int = 0

    @property
    def language_model(self) -> int:
        """What Miles loads and trains."""
        return self.embedding + self.lm_head + self.layers + self.experts + self.other

    @property
    def total(self) -> int:
        """Every parameter of the checkpoint's transformers model."""
        return self.language_model + self.vision


@dataclass(frozen=True)
class ModelShape:
    """Sizes the memory planner needs, all in elements (the planner applies dtypes)."""

    params: ParamCounts
    num_layers: int
    hidden_size: int
    vocab_size: int
    # Routed-expert parameters one token uses (top-k of each MoE layer); for FLOPs and reports.
    active_expert_params: int
    kv_elems_per_token: int  # KV-cache elements per token, summed over layers (K+V, or latent)
    # Elements one sequence holds whatever its length: linear-attention states, sliding windows.
    state_elems_per_seq: int
    # Elements the decoder layers keep per token for backward (summed over layers, no
    # recomputation): an estimate from the layer's widths, not a measurement.
    act_elems_per_token: int


@dataclass(frozen=True)
class ParallelHints:
    """What tensor and expert parallel sizes must divide, as (config field, value) pairs."""

    tensor_divides: tuple[tuple[str, int], ...] = ()
    expert_divides: tuple[tuple[str, int], ...] = ()

    def problems(self, tensor: int, expert: int, where: str) -> list[str]:
        out = []
        for size, label, pairs in (
            (tensor, "tensor", self.tensor_divides),
            (expert, "expert", self.expert_divides),
        ):
            for name, value in pairs:
                if size > 1 and value % size:
                    out.append(
                        f"{where}: {label} parallel size {size} does not divide the model's "
                        f"{name} ({value})"
                    )
        return out


@dataclass(frozen=True)
class Notice:
    """Something about a config the family does not support. Fatal ones stop the load (Miles
    would otherwise run a different model); the others are said once, at load time."""

    message: str
    fatal: bool = False


def _no_notices(config: Config) -> list[Notice]:
    return []


@dataclass(frozen=True)
class ModelFamily:
    """A model family component (`model.family`, or found by the checkpoint's model_type)."""

    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values this family covers
    router: RouterAdapter | None = None  # None: a dense family, nothing to replay
    # Exact sizes from a config.json (the top-level one, multimodal wrapper included).
    shape: Callable[[Config], ModelShape] | None = None
    parallel: Callable[[Config], ParallelHints] | None = None
    notices: Callable[[Config], list[Notice]] = _no_notices
    # The tiny twin: config.json fields (model_type included) of a few-layer, narrow model of the
    # same architecture class; vocabulary and special token ids are filled in by the writer.
    tiny: Callable[[], dict[str, Any]] | None = None
    # Fills, in a freshly initialised twin, what transformers' init leaves degenerate but a real
    # checkpoint has (e.g. DeepSeek-V4's token -> expert hash table, zeros at init). Seeded.
    tiny_init: Callable[[Any], None] | None = None
    # (path, **from_pretrained kwargs) -> the causal LM Miles trains; None: AutoModelForCausalLM.
    load: Callable[..., Any] | None = None
    chat_template: str | None = None  # Jinja, for tokenizers that ship none
    summary: str = ""
    # The real checkpoints this family was written against, and their config.json (so plans of a
    # hub id work without downloading it).
    checkpoints: tuple[str, ...] = field(default=())
    config_for: Callable[[str], dict[str, Any] | None] | None = None


def text_config(config: Config) -> Config:
    """The language model's part of a config.json (itself, unless it wraps a `text_config`)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def quantization_config(config: Config) -> Mapping[str, Any] | None:
    """A checkpoint's quantization_config (a multimodal wrapper's, or its text model's)."""
    for source in (config, text_config(config)):
        quant = source.get("quantization_config")
        if isinstance(quant, Mapping):
            return quant
    return None


def dequantizing(config: Config | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """from_pretrained kwargs that load a pre-quantized checkpoint (fp8 blocks, compressed-tensors)
    as plain weights. Miles trains and syncs full-precision weights; on a GPU that can run the
    format, transformers would otherwise build quantized modules that cannot be trained. A
    quantization_config the caller passed stays; families' notices say what a format needs."""
    quant = quantization_config(config) if config is not None else None
    if quant is None or quant.get("dequantize") or "quantization_config" in kwargs:
        return kwargs
    method = quant.get("quant_method")
    if method == "fp8":
        from transformers import FineGrainedFP8Config

        return {**kwargs, "quantization_config": FineGrainedFP8Config(dequantize=True)}
    if method == "compressed-tensors":
        from transformers import CompressedTensorsConfig

        return {**kwargs, "quantization_config": CompressedTensorsConfig(dequantize=True)}
    return kwargs


def family_for(manager: Any, model_type: str) -> ModelFamily | None:
    """The installed family that covers `model_type`, if any."""
    from miles.core.components import Kind

    for name in manager.registry.names(Kind.FAMILY):
        family = manager.get(Kind.FAMILY, name).spec.factory()
        if model_type in family.model_types:
            return family  # type: ignore[no-any-return]
    return None


def family_of_config(manager: Any, config: Config) -> ModelFamily | None:
    """The family for a config.json: by its own model_type, else its text model's."""
    for model_type in (config.get("model_type"), text_config(config).get("model_type")):
        if model_type:
            family = family_for(manager, str(model_type))
            if family is not None:
                return family
    return None


def read_config(model_path: str) -> dict[str, Any] | None:
    """A local checkpoint's config.json; None for a hub id or a directory without one."""
    import json
    from pathlib import Path

    file = Path(model_path) / "config.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    return data if isinstance(data, dict) else None


def model_config(manager: Any, model_path: str) -> tuple[dict[str, Any], ModelFamily | None] | None:
    """(config.json, family) of a local checkpoint, or of a hub id some family knows; None if
    neither."""
    config = read_config(model_path)
    if config is not None:
        return config, family_of_config(manager, config)
    from miles.core.components import Kind

    for name in manager.registry.names(Kind.FAMILY):
        family: ModelFamily = manager.get(Kind.FAMILY, name).spec.factory()
        if model_path in family.checkpoints and family.config_for is not None:
            known = family.config_for(model_path)
            if known is not None:
                return known, family
    return None


def loading_family(model_path: str) -> tuple[ModelFamily | None, dict[str, Any] | None]:
    """(family, config.json) for loading `model_path` (a local checkpoint; a hub id gets its
    config through transformers), after checking the family's notices: a fatal one raises
    ValueError, the others are logged once per process."""
    from miles.core.plugins import get_plugin_manager

    config = read_config(model_path)
    if config is None:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path).to_dict()
        except (OSError, ValueError):
            return None, None
    family = family_of_config(get_plugin_manager(), config)
    if family is None:
        return None, config
    for notice in family.notices(config):
        if notice.fatal:
            raise ValueError(f"model family {family.name!r}: {notice.message}")
        _say_once(family.name, notice.message)
    return family, config


_said: set[str] = set()


def _say_once(family: str, message: str) -> None:
    if message in _said:
        return
    _said.add(message)
    import structlog

    structlog.get_logger(__name__).warning("model family notice", family=family, notice=message)


def load_tokenizer(model_path: str) -> Any:
    """The checkpoint's tokenizer; when it ships no chat template, its family's."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if getattr(tokenizer, "chat_template", None) is None:
        config = read_config(model_path)
        if config is not None:
            from miles.core.plugins import get_plugin_manager

            family = family_of_config(get_plugin_manager(), config)
            if family is not None and family.chat_template is not None:
                tokenizer.chat_template = family.chat_template
    return tokenizer


def notices_for(manager: Any, model_path: str, family_name: str | None = None) -> list[Notice]:
    """The notices of a local checkpoint's family (`family_name` overrides detection); [] for
    a hub id or a model no family covers."""
    config = read_config(model_path) if model_path else None
    if config is None:
        return []
    if family_name is not None:
        from miles.core.components import Kind

        try:
            family: ModelFamily | None = manager.get(Kind.FAMILY, family_name).spec.factory()
        except LookupError:
            return []  # validate says so
    else:
        family = family_of_config(manager, config)
    if family is None:
        return []
    return [Notice(f"{family.name}: {n.message}", n.fatal) for n in family.notices(config)]
