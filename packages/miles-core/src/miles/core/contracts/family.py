"""Model families: what Miles needs to know about a transformers architecture beyond its weights.

A family (component kind `family`, found by the checkpoint's `model_type`) covers:
- **loading**: which causal LM a checkpoint becomes, and under which weight names (a multimodal
  checkpoint's language model, for instance);
- **MoE routers**, for routing replay (`router`);
- **the chat template** to use when a checkpoint's tokenizer ships none;
- **shape**: exact parameter counts, KV-cache and activation sizes, for the memory planner;
- **parallelism hints**: which dimensions tensor and expert parallelism must divide;
- **what is not supported** for a given config, said at load time (`notices`);
- **a tiny twin**: the same architecture with tiny dimensions, for tests and laptops;
- **its Megatron-core mapping** (`megatron`): the GPTModel it becomes and which Hugging Face
  weights make each Megatron parameter, as data; miles-megatron does the tensor work.

Everything here works on a checkpoint's `config.json` as a plain dict, so it is torch-free:
`miles recipes plan` sizes a trillion-parameter model without building it. Finding the family of
a checkpoint is `miles.core.registry.families`; loading one (transformers) is the train and rollout
backends' business (miles-torch's `load_causal_lm`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Config = Mapping[str, Any]  # a config.json, as loaded by json.load


class RouterAdapter(Protocol):
    """Where an MoE architecture's routers are and how they weigh experts: what routing replay
    needs (miles-torch records and replays with forward hooks on these routers). Tensors are
    torch tensors; the contract stays torch-free."""

    def routers(self, model: Any) -> list[Any]:
        """The router module of every MoE layer, in layer order (dense layers skipped)."""
        ...

    def gate_weights(self, router: Any, logits: Any, indices: Any) -> Any:
        """The gate weights the router would give `indices` ([tokens, top_k]) from `logits`."""
        ...


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
class MegatronWeight:
    """One Megatron-core parameter, by its local-spec name, and the Hugging Face weights it is
    made of. Names may hold `{layer}` (global decoder layer) and `{expert}` (global expert)."""

    megatron: str
    hf: tuple[str, ...]
    # How the parts become one tensor: as is, Megatron's fused QKV (per query group: its query
    # heads, then its key, then its value), or gate and up stacked for the fused SwiGLU.
    join: Literal["copy", "qkv", "gate_up"] = "copy"
    # How tensor parallelism cuts it: output rows ("column"), input columns ("row"), vocabulary
    # rows padded to Megatron's padded vocabulary ("vocab"), or not at all (None).
    split: Literal["column", "row", "vocab"] | None = None
    layers: tuple[int, ...] = ()  # the global layers it exists in, when the name has {layer}


@dataclass(frozen=True)
class MegatronMapping:
    """A family's Megatron-core GPTModel, as plain data: built and filled by miles-megatron."""

    weights: tuple[MegatronWeight, ...]
    # TransformerConfig fields with plain values (`activation` names the MLP's activation
    # function, e.g. "silu"); the backend adds dtypes, parallel sizes and fusions.
    transformer: Mapping[str, Any]
    # GPTModel arguments: vocab_size, max_sequence_length, rotary_base,
    # share_embeddings_and_output_weights, position_embedding_type.
    model: Mapping[str, Any]
    num_experts: int = 0  # routed experts per MoE layer, for names with {expert}
    # What the config asks for that this GPTModel cannot express: the backend refuses the model
    # with these, before launch.
    unsupported: tuple[str, ...] = ()


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
    # Every sequence-mixing layer is attention through transformers' attention interface, so
    # sequences packed into one row (position ids restarting per sequence, cumulative lengths)
    # train without padding. False: micro-batches are right-padded blocks with a mask.
    packed_sequences: bool = False
    # Class names of the model's norm modules that compute Llama's RMSNorm exactly
    # (`weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`, attributes `weight` and
    # `variance_epsilon`): the trainer may run them as fused kernels.
    rms_norms: tuple[str, ...] = ()
    # The decoder layer traces whole under torch.compile and trains faster compiled (measured):
    # the fsdp trainer compiles it on CUDA by default (`train.compile: auto`). Families where
    # compiling costs more start-up than it saves (MoE expert loops, say) leave it off.
    compile_layers: bool = False
    summary: str = ""
    # The real checkpoints this family was written against, and their config.json (so plans of a
    # hub id work without downloading it).
    checkpoints: tuple[str, ...] = field(default=())
    config_for: Callable[[str], dict[str, Any] | None] | None = None
    # The Megatron-core model of a config.json; None: the megatron backend cannot train it.
    megatron: Callable[[Config], MegatronMapping] | None = None
    # Without `megatron`: what of the architecture megatron-core cannot express (the refusal
    # says it).
    megatron_missing: str = ""


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
