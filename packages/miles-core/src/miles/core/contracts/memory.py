"""Memory models: how many bytes one GPU holds, by what holds them, for the planner to add up.

A train backend, a rollout backend and a precision each declare a memory model in their
`ComponentSpec` (`memory=`). The building blocks here are the arithmetic the common designs
share, torch-free, so a backend's model is a few lines over its own options:

- `sharded_data_parallel`: FSDP / ZeRO-3 (fp32 master weights, gradients and AdamW state sharded
  over every train rank, one layer gathered at a time);
- `model_parallel`: Megatron-style (a tensor x pipeline (x expert) share of the model per rank,
  with a distributed optimizer over data parallelism);
- `engine`: a rollout engine (weights, the KV cache of the sequences it runs at once, and the
  prefill working set).

A backend that is not installed here is sized by `generic_train` / `generic_rollout`, which read
only the options every such estimate needs (see `GenericTrainOptions`) and say so in the plan.
Parameter counts are exact (the model family's `shape`); activations and KV sizes are estimates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from miles.core.config import RunConfig
from miles.core.config.tools import ConfigError, build
from miles.core.contracts.family import ModelShape

# The lm_head's output in the compute dtype, then in fp32 (log-softmax, its exp for the entropy,
# and the gradients of both): 16 bytes per logit besides the compute dtype's.
_LOGIT_FP32_BYTES = 16
# A head computed a chunk of tokens at a time holds one chunk's logits in fp32 (the logits, their
# exp, the log-softmax, their gradient) and the weight's gradient in fp32.
_CHUNK_FP32_BYTES = 16
# SGLang's default prefill chunk: engines that chunk their prefill hold this many tokens at once.
DEFAULT_PREFILL_CHUNK = 16384


@dataclass(frozen=True)
class Layout:
    """Where the run puts its GPUs."""

    train_gpus: int
    tensor: int
    pipeline: int
    expert: int
    context: int
    engines: int
    gpus_per_engine: int
    colocated: bool

    @property
    def data_parallel(self) -> int:
        return self.train_gpus // (self.tensor * self.pipeline * self.context)

    @property
    def rollout_gpus(self) -> int:
        return self.engines * self.gpus_per_engine

    @property
    def total_gpus(self) -> int:
        if self.colocated:
            return max(self.train_gpus, self.rollout_gpus)
        return self.train_gpus + self.rollout_gpus

    def describe(self) -> str:
        train = (
            f"train {_n(self.train_gpus, 'GPU')} (TP {self.tensor} x PP {self.pipeline} x "
            f"CP {self.context}, DP {self.data_parallel}, EP {self.expert})"
        )
        rollout = (
            f"rollout {_n(self.engines, 'engine')} x {_n(self.gpus_per_engine, 'GPU')} "
            f"(engine TP {self.gpus_per_engine}, DP {self.engines})"
        )
        where = "colocated on the same GPUs" if self.colocated else "on separate GPUs"
        return f"{train}; {rollout}; {where}: {_n(self.total_gpus, 'GPU')}"


def layout_of(config: RunConfig) -> Layout:
    p = config.train.parallel
    return Layout(
        train_gpus=config.train.world_size,
        tensor=p.tensor,
        pipeline=p.pipeline,
        expert=p.expert,
        context=p.context,
        engines=config.rollout.engines,
        gpus_per_engine=config.rollout.gpus_per_engine,
        colocated=config.placement == "colocated",
    )


# ── what a memory model gets and returns ─────────────────────────────────────────────────────────


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element: activations and KV cache (`compute`), and the weights engines hold
    (`rollout_weights`, a quantized format's scales included)."""

    compute: float
    rollout_weights: float


@dataclass(frozen=True)
class TrainInputs:
    """What the run decides for a train GPU's memory."""

    shape: ModelShape
    layout: Layout
    compute_bytes: float
    lora: bool  # only the adapters train: no gradients or optimizer state for the base
    reference: bool  # the initial policy is kept for reference logprobs (KL)


@dataclass(frozen=True)
class TrainBytes:
    """One train GPU: bytes by what holds them, and how to read them."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    micro_batch_tokens: int  # the activation estimate's micro-batch, for the plan's table
    notes: tuple[str, ...] = ()
    # What the user can change when one row dominates a plan that does not fit, by row.
    advice: Mapping[str, str] = field(default_factory=dict)

    @property
    def rows(self) -> dict[str, float]:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
        }


@dataclass(frozen=True)
class RolloutInputs:
    """What the run decides for a rollout GPU's memory."""

    shape: ModelShape
    layout: Layout
    compute_bytes: float  # KV cache and activations
    weight_bytes: float  # the weights, as the precision sends them
    requests_per_step: int  # prompts_per_step x samples_per_prompt, spread over the engines
    prompt_tokens: int  # the prompt length the KV cache is sized for
    max_new_tokens: int


@dataclass(frozen=True)
class RolloutBytes:
    """One rollout GPU: bytes by what holds them, and how to read them."""

    weights: float
    kv_cache: float
    activations: float
    concurrency: int  # sequences one engine runs at once
    prefill_tokens: int  # prompt tokens one prefill forward holds
    notes: tuple[str, ...] = ()
    advice: Mapping[str, str] = field(default_factory=dict)
    # Tokens of an engine that allocates its KV cache whole, up front (None: it grows with
    # `concurrency` sequences).
    cache_tokens: int | None = None

    @property
    def rows(self) -> dict[str, float]:
        return {"weights": self.weights, "kv_cache": self.kv_cache, "activations": self.activations}


# (inputs, the backend's own built config section, or its raw options when not installed)
TrainMemoryModel = Callable[[TrainInputs, Any], TrainBytes]
RolloutMemoryModel = Callable[[RolloutInputs, Any], RolloutBytes]
# (the precision's built config, or None when it takes no options)
PrecisionMemoryModel = Callable[[Any], PrecisionBytes]


# ── building blocks ──────────────────────────────────────────────────────────────────────────────


def activations(
    inputs: TrainInputs,
    micro_batch_tokens: int,
    activation_checkpointing: bool,
    logit_chunk_tokens: int | None = None,
    layer_factor: float = 1.0,
) -> float:
    """One micro-batch: every layer's saved activations (or only each layer's input with
    activation checkpointing, plus one layer recomputed), and the logits with their fp32
    log-softmax: of every token at once, or of `logit_chunk_tokens` at a time for a backend
    that computes its head in chunks. Tensor (with sequence) and context parallelism split
    them. The family's per-layer estimate counts what fused layers keep; `layer_factor` scales
    it for a backend whose layers keep more (measured, e.g. megatron-core's local spec)."""
    shape, layout, act_bytes = inputs.shape, inputs.layout, inputs.compute_bytes
    tokens = float(micro_batch_tokens)
    per_layer_elems = shape.act_elems_per_token * layer_factor
    if activation_checkpointing:
        per_layer = per_layer_elems / max(shape.num_layers, 1)
        saved = tokens * (shape.hidden_size * shape.num_layers + per_layer) * act_bytes
    else:
        saved = tokens * per_layer_elems * act_bytes
    if logit_chunk_tokens is None:
        logits = tokens * shape.vocab_size * (act_bytes + _LOGIT_FP32_BYTES)
    else:
        chunk = min(tokens, float(logit_chunk_tokens))
        logits = chunk * shape.vocab_size * (act_bytes + _CHUNK_FP32_BYTES)
        logits += 4 * shape.vocab_size * shape.hidden_size  # the head's fp32 gradient
    return (saved + logits) / (layout.tensor * layout.context)


def sharded_data_parallel(
    inputs: TrainInputs,
    *,
    micro_batch_tokens: int,
    activation_checkpointing: bool,
    reference_copy: bool,
    advice: Mapping[str, str] | None = None,
    logit_chunk_tokens: int | None = None,
    frozen_bytes: float = 4,
) -> TrainBytes:
    """FSDP / ZeRO-3: fp32 master weights, fp32 gradients and AdamW's two fp32 moments sharded
    over every train rank; the layer being computed is gathered whole (in the compute dtype).
    `reference_copy`: a frozen fp32 copy of the initial weights, sharded the same way.
    `frozen_bytes`: bytes a parameter of a frozen LoRA base is kept in."""
    params, shape = inputs.shape.params, inputs.shape
    shards = inputs.layout.train_gpus
    trainable = 0 if inputs.lora else params.language_model
    biggest_layer = (params.layers + params.experts) / max(shape.num_layers, 1)
    stored = frozen_bytes if inputs.lora else 4
    weights = stored * params.language_model / shards + inputs.compute_bytes * biggest_layer
    if reference_copy:
        weights += 4 * params.language_model / shards
    return TrainBytes(
        weights=weights,
        gradients=4 * trainable / shards,
        optimizer=8 * trainable / shards,
        activations=activations(
            inputs, micro_batch_tokens, activation_checkpointing, logit_chunk_tokens
        ),
        micro_batch_tokens=micro_batch_tokens,
        notes=_lora_note(inputs),
        advice=advice or {},
    )


def model_parallel(
    inputs: TrainInputs,
    *,
    micro_batch_tokens: int,
    activation_checkpointing: bool,
    advice: Mapping[str, str] | None = None,
    logit_chunk_tokens: int | None = None,
    layer_factor: float = 1.0,
) -> TrainBytes:
    """Megatron-style: compute-dtype weights and fp32 gradients of this rank's model-parallel
    share; fp32 master weights and AdamW moments spread over data parallelism as well (the
    distributed optimizer). `logit_chunk_tokens`: the head's logits are made that many tokens
    at a time (None: all of a micro-batch's at once); `layer_factor`: see `activations`."""
    per_rank = model_parallel_share(inputs.shape, inputs.layout)
    trainable = 0 if inputs.lora else per_rank
    return TrainBytes(
        weights=inputs.compute_bytes * per_rank,
        gradients=4 * trainable,
        optimizer=12 * trainable / inputs.layout.data_parallel,
        activations=activations(
            inputs, micro_batch_tokens, activation_checkpointing, logit_chunk_tokens, layer_factor
        ),
        micro_batch_tokens=micro_batch_tokens,
        notes=_lora_note(inputs),
        advice=advice or {},
    )


def model_parallel_share(shape: ModelShape, layout: Layout) -> float:
    """Parameters one rank holds under TP x PP (and EP for routed experts): its stage's layers,
    plus the embedding or head (vocab-parallel), whichever is larger."""
    p = shape.params
    dense = (p.layers + p.other) / (layout.pipeline * layout.tensor)
    experts = p.experts / (layout.pipeline * layout.expert)
    ends = max(p.embedding, p.lm_head) / layout.tensor
    return dense + experts + ends


def engine(
    inputs: RolloutInputs,
    *,
    max_batch_size: int | None,
    prefill_chunk_tokens: int | None,
    advice: Mapping[str, str] | None = None,
    notes: tuple[str, ...] = (),
) -> RolloutBytes:
    """Weights split over an engine's GPUs; the KV cache of the sequences it runs at once (a
    step's requests spread over the engines, capped by `max_batch_size`); and one layer's working
    set while it prefills their prompts, all at once or in chunks of `prefill_chunk_tokens`."""
    shape, layout = inputs.shape, inputs.layout
    concurrency = math.ceil(inputs.requests_per_step / layout.engines)
    if max_batch_size:
        concurrency = min(concurrency, max_batch_size)
    prefill = concurrency * inputs.prompt_tokens
    if prefill_chunk_tokens is not None:
        prefill = min(prefill, prefill_chunk_tokens)
    seq_tokens = inputs.prompt_tokens + inputs.max_new_tokens
    kv = concurrency * (seq_tokens * shape.kv_elems_per_token + shape.state_elems_per_seq)
    per_layer = shape.act_elems_per_token / max(shape.num_layers, 1)
    gpus = layout.gpus_per_engine
    return RolloutBytes(
        weights=inputs.weight_bytes * shape.params.language_model / gpus,
        kv_cache=kv * inputs.compute_bytes / gpus,
        activations=prefill * per_layer * inputs.compute_bytes / gpus,
        concurrency=concurrency,
        prefill_tokens=prefill,
        notes=notes,
        advice=advice or {},
    )


def _lora_note(inputs: TrainInputs) -> tuple[str, ...]:
    if not inputs.lora:
        return ()
    return ("LoRA: gradients and optimizer state only for the adapters (not counted)",)


# ── backends not installed here ──────────────────────────────────────────────────────────────────


@dataclass
class GenericTrainOptions:
    """The options the generic train estimate reads, where a backend names them alike."""

    micro_batch_tokens: int = 8192
    activation_checkpointing: bool = False


@dataclass
class GenericRolloutOptions:
    """The option the generic rollout estimate reads, where a backend names it alike."""

    max_batch_size: int | None = None


GENERIC_PRECISION = PrecisionBytes(compute=2, rollout_weights=2)  # bf16


def generic_train(inputs: TrainInputs, options: Mapping[str, Any]) -> TrainBytes:
    """A backend this machine does not have: the model-parallel estimate (the layout says how
    the model is split; at TP = PP = EP = 1 it is a distributed-optimizer data-parallel run)."""
    o = _lenient(GenericTrainOptions, options)
    return model_parallel(
        inputs,
        micro_batch_tokens=o.micro_batch_tokens,
        activation_checkpointing=o.activation_checkpointing,
        advice=_GENERIC_TRAIN_ADVICE,
    )


def generic_rollout(inputs: RolloutInputs, options: Mapping[str, Any]) -> RolloutBytes:
    """A backend this machine does not have: an engine that chunks its prefill."""
    o = _lenient(GenericRolloutOptions, options)
    return engine(
        inputs,
        max_batch_size=o.max_batch_size,
        prefill_chunk_tokens=DEFAULT_PREFILL_CHUNK,
        advice=GENERIC_ROLLOUT_ADVICE,
    )


_GENERIC_TRAIN_ADVICE = {
    "activations": "lower train.micro_batch_tokens or set train.activation_checkpointing: true",
}
GENERIC_ROLLOUT_ADVICE = {
    "kv_cache": "lower the rollout concurrency (rollout.max_batch_size) or raise "
    "rollout.gpus_per_engine",
    "activations": "lower the rollout concurrency (rollout.max_batch_size) or "
    "planner.prompt_tokens",
}


def _lenient(cls: type[Any], options: Mapping[str, Any]) -> Any:
    """`cls` from the options it knows, defaults where they are missing or malformed."""
    own = {f.name for f in dataclasses.fields(cls)}
    try:
        return build(cls, {k: v for k, v in options.items() if k in own})
    except ConfigError:
        return cls()


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")
