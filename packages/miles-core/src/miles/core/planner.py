"""The memory and placement planner: what one GPU holds for a run config, before anything starts.

Per train GPU: weights, gradients and optimizer state (by the train backend's sharding), and
activations of one micro-batch. Per rollout GPU: the engine's weights and the KV cache of the
configured concurrency. Parameter counts are exact (each family's `shape`, tested against
transformers); activation and KV sizes follow from the model's widths and are estimates.

`miles recipes plan NAME --gpus N --gpu-mem 141GB` prints a plan; `miles run` refuses a layout
whose plan does not fit, before launch. Torch-free: it sizes a trillion-parameter model from its
config.json alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from miles.core.components import Kind
from miles.core.config import RunConfig
from miles.core.family import ModelFamily, ModelShape, model_config

GB = 1e9

# Bytes per element: (activations and KV cache, rollout weights). A quantized rollout format
# keeps its scales too: about 1/32 (fp8 128x128 blocks much less, mxfp8 1x32, int4 groups of 128).
_PRECISIONS: dict[str, tuple[float, float]] = {
    "fp32": (4, 4),
    "bf16": (2, 2),
    "fp8": (2, 1 + 4 / 128**2),
    "mxfp8": (2, 1 + 1 / 32),
    "int4-qat": (2, 0.5 + 2 / 128),
}


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


@dataclass(frozen=True)
class Plan:
    """Bytes per GPU, by what holds them."""

    run: RunConfig  # the planned config, backend options with their defaults
    model: str
    family: str
    shape: ModelShape
    layout: Layout
    precision: str
    train: dict[str, float]  # weights, gradients, optimizer, activations
    rollout: dict[str, float]  # weights, kv_cache
    gpu_mem: float | None  # bytes; None: not known, nothing to check against
    usable_fraction: float
    notes: tuple[str, ...]

    @property
    def train_total(self) -> float:
        return sum(self.train.values())

    @property
    def rollout_total(self) -> float:
        return sum(self.rollout.values())

    @property
    def peak(self) -> float:
        """The most one GPU holds: a train GPU or a rollout GPU. Colocated, the two share a GPU
        but take turns (engines release their memory while the trainer trains, and the trainer
        offloads while they generate), so the larger of the two again."""
        return max(self.train_total, self.rollout_total)

    @property
    def usable(self) -> float | None:
        return None if self.gpu_mem is None else self.gpu_mem * self.usable_fraction

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.peak <= self.usable

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "family": self.family,
            "params": dataclasses.asdict(self.shape.params)
            | {
                "language_model": self.shape.params.language_model,
                "total": self.shape.params.total,
            },
            "layout": dataclasses.asdict(self.layout)
            | {"data_parallel": self.layout.data_parallel},
            "precision": self.precision,
            "train_gb": {k: v / GB for k, v in self.train.items()},
            "rollout_gb": {k: v / GB for k, v in self.rollout.items()},
            "peak_gb": self.peak / GB,
            "gpu_mem_gb": None if self.gpu_mem is None else self.gpu_mem / GB,
            "usable_gb": None if self.usable is None else self.usable / GB,
            "fits": self.fits,
            "notes": list(self.notes),
        }


class PlanError(ValueError):
    """The config cannot be planned: an impossible layout, or a model that cannot be sized."""


class UnsizedModel(PlanError):
    """Nothing here knows the model's architecture (no config.json, no family with a shape)."""


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


def rescale(layout: Layout, gpus: int) -> Layout:
    """The layout on `gpus` GPUs: the same model-parallel shapes (train TP x PP x CP, engine
    size) and the same train : rollout split, with data parallelism (train replicas, engines)
    grown or shrunk to fit."""
    # Train GPUs come in whole replicas (TP x PP x CP) whose pipeline stages EP divides.
    replica = math.lcm(
        layout.tensor * layout.pipeline * layout.context, layout.pipeline * layout.expert
    )
    if layout.colocated:
        train_gpus = gpus // replica * replica
        engines = train_gpus // layout.gpus_per_engine
    else:
        share = layout.train_gpus / layout.total_gpus
        train_gpus = max(replica, int(gpus * share) // replica * replica)
        engines = (gpus - train_gpus) // layout.gpus_per_engine
    if train_gpus < replica or engines < 1:
        need = replica + (0 if layout.colocated else layout.gpus_per_engine)
        raise PlanError(
            f"{gpus} GPUs cannot hold one train replica ({replica} GPUs: TP x PP x CP, with EP "
            f"dividing each pipeline stage) and one rollout engine ({layout.gpus_per_engine} "
            f"GPUs): this layout needs at least {need}"
        )
    return dataclasses.replace(layout, train_gpus=train_gpus, engines=engines)


def layout_problems(
    layout: Layout, family: ModelFamily | None, config: dict[str, Any]
) -> list[str]:
    problems = []
    replica = layout.tensor * layout.pipeline * layout.context
    if layout.train_gpus % replica:
        problems.append(
            f"train.world_size {layout.train_gpus} is not a multiple of tensor x pipeline x "
            f"context ({replica})"
        )
    if layout.expert > 1 and (layout.train_gpus // layout.pipeline) % layout.expert:
        problems.append(
            f"train.parallel.expert {layout.expert} must divide the GPUs of a pipeline stage "
            f"({layout.train_gpus // layout.pipeline})"
        )
    if family is not None and family.parallel is not None:
        hints = family.parallel(config)
        # Training's shapes only: inference engines replicate KV heads past their count.
        problems += hints.problems(layout.tensor, layout.expert, "train.parallel")
    return problems


def plan(
    run: RunConfig,
    manager: Any,
    *,
    gpus: int | None = None,
    gpu_mem_gb: float | None = None,
) -> Plan:
    """The plan of `run` (optionally re-laid-out on `gpus` GPUs of `gpu_mem_gb` each)."""
    found = model_config(manager, run.model.path)
    if found is None:
        raise UnsizedModel(
            f"model.path {run.model.path!r}: no config.json there, and no installed family knows "
            "this checkpoint id; download the checkpoint (or its config.json) and point "
            "model.path at it"
        )
    config, family = found
    if run.model.family is not None:
        family = manager.get(Kind.FAMILY, run.model.family).spec.factory()
    if family is None or family.shape is None:
        model_type = config.get("model_type")
        raise UnsizedModel(
            f"no installed model family can size model_type {model_type!r}; install "
            "miles-recipes, or add a family with a `shape` (see docs/recipes.md)"
        )
    # Backend options with their defaults (the engine's max_batch_size, micro_batch_tokens...).
    run = dataclasses.replace(
        run,
        train=dataclasses.replace(
            run.train,
            options=backend_options(
                manager, Kind.TRAIN_BACKEND, run.train.backend, run.train.options
            ),
        ),
        rollout=dataclasses.replace(
            run.rollout,
            options=backend_options(
                manager, Kind.ROLLOUT_BACKEND, run.rollout.backend, run.rollout.options
            ),
        ),
    )
    layout = layout_of(run)
    if gpus is not None:
        layout = rescale(layout, gpus)
    problems = layout_problems(layout, family, config)
    if problems:
        raise PlanError("; ".join(problems))
    try:
        shape = family.shape(config)
    except Exception as exc:  # a plugin's arithmetic on a config it did not expect
        raise PlanError(
            f"model family {family.name!r} cannot size this config.json: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    notes: list[str] = []
    act_bytes, rollout_bytes = _precision_bytes(run.precision.name, notes)
    train = _train_memory(run, shape, layout, act_bytes, notes)
    rollout = _rollout_memory(run, shape, layout, act_bytes, rollout_bytes)
    mem_gb = gpu_mem_gb if gpu_mem_gb is not None else run.planner.gpu_mem_gb
    return Plan(
        run=run,
        model=run.model.path,
        family=family.name,
        shape=shape,
        layout=layout,
        precision=run.precision.name,
        train=train,
        rollout=rollout,
        gpu_mem=None if mem_gb is None else mem_gb * GB,
        usable_fraction=run.planner.usable_fraction,
        notes=tuple(notes),
    )


def backend_options(manager: Any, kind: str, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A backend's options with its config's defaults filled in (as given when the backend is
    not installed here)."""
    from miles.core.configtools import ConfigError, build

    try:
        spec = manager.get(kind, name).spec
    except LookupError:
        return dict(options)
    if spec.config is None:
        return dict(options)
    own = {f.name for f in dataclasses.fields(spec.config)}
    try:
        built = build(spec.config, {k: v for k, v in options.items() if k in own})
    except ConfigError:
        return dict(options)
    return {f.name: getattr(built, f.name) for f in dataclasses.fields(built)}


def _precision_bytes(name: str, notes: list[str]) -> tuple[float, float]:
    if name in _PRECISIONS:
        return _PRECISIONS[name]
    notes.append(f"precision {name!r} has no memory model here: sized as bf16")
    return _PRECISIONS["bf16"]


def _train_memory(
    run: RunConfig, shape: ModelShape, layout: Layout, act_bytes: float, notes: list[str]
) -> dict[str, float]:
    params = shape.params
    options = run.train.options
    trainable = params.language_model
    if run.lora is not None:
        trainable = 0  # adapters are a fraction of a percent; their state is not worth a row
        notes.append("LoRA: gradients and optimizer state only for the adapters (not counted)")
    if run.train.backend == "fsdp":
        # FSDP2 shards fp32 master weights, fp32 gradients and AdamW's two fp32 moments over
        # every train rank; the layer being computed is gathered whole (in the compute dtype).
        shards = layout.train_gpus
        biggest_layer = (params.layers + params.experts) / max(shape.num_layers, 1)
        weights = 4 * params.language_model / shards + act_bytes * biggest_layer
        grads = 4 * trainable / shards
        optimizer = 8 * trainable / shards
        if options.get("ref_model") and options.get("ref_mode", "copy") == "copy":
            weights += 4 * params.language_model / shards
    else:
        # Megatron-style: compute-dtype weights and fp32 gradients of this rank's model-parallel
        # shard; fp32 master weights and AdamW moments spread over data parallelism as well
        # (the distributed optimizer).
        per_rank = _model_parallel_share(shape, layout)
        trainable_share = per_rank if run.lora is None else 0
        weights = act_bytes * per_rank
        grads = 4 * trainable_share
        optimizer = 12 * trainable_share / layout.data_parallel
    return {
        "weights": weights,
        "gradients": grads,
        "optimizer": optimizer,
        "activations": _activations(run, shape, layout, act_bytes),
    }


def _model_parallel_share(shape: ModelShape, layout: Layout) -> float:
    """Parameters one rank holds under TP x PP (and EP for routed experts): its stage's layers,
    plus the embedding or head (vocab-parallel), whichever is larger."""
    p = shape.params
    dense = (p.layers + p.other) / (layout.pipeline * layout.tensor)
    experts = p.experts / (layout.pipeline * layout.expert)
    ends = max(p.embedding, p.lm_head) / layout.tensor
    return dense + experts + ends


def _activations(run: RunConfig, shape: ModelShape, layout: Layout, act_bytes: float) -> float:
    """One micro-batch of `micro_batch_tokens`: every layer's saved activations (or only each
    layer's input with activation checkpointing, plus one layer recomputed), and the logits
    with their fp32 log-softmax. Tensor (with sequence) and context parallelism split them."""
    options = run.train.options
    tokens = float(options.get("micro_batch_tokens", 8192))
    split = layout.tensor * layout.context
    if options.get("activation_checkpointing", False):
        per_layer = shape.act_elems_per_token / max(shape.num_layers, 1)
        saved = tokens * (shape.hidden_size * shape.num_layers + per_layer) * act_bytes
    else:
        saved = tokens * shape.act_elems_per_token * act_bytes
    # The lm_head's output in the compute dtype, then in fp32 (see miles.torch's token_logprobs):
    # the log-softmax, its exp (for the entropy) and the gradients of both, 16 bytes a logit.
    logits = tokens * shape.vocab_size * (act_bytes + 16)
    return (saved + logits) / split


def _rollout_memory(
    run: RunConfig, shape: ModelShape, layout: Layout, kv_bytes: float, weight_bytes: float
) -> dict[str, float]:
    """Weights split over an engine's GPUs; the KV cache of the sequences it runs at once (a
    step's requests spread over the engines, capped by the engine's max_batch_size); and one
    layer's working set while it prefills their prompts."""
    concurrency = rollout_concurrency(run, layout)
    seq_tokens = run.planner.prompt_tokens + run.rollout.max_new_tokens
    kv = concurrency * (seq_tokens * shape.kv_elems_per_token + shape.state_elems_per_seq)
    per_layer = shape.act_elems_per_token / max(shape.num_layers, 1)
    return {
        "weights": weight_bytes * shape.params.language_model / layout.gpus_per_engine,
        "kv_cache": kv * kv_bytes / layout.gpus_per_engine,
        "activations": prefill_tokens(run, layout) * per_layer * kv_bytes / layout.gpus_per_engine,
    }


def prefill_tokens(run: RunConfig, layout: Layout) -> int:
    """Prompt tokens one prefill forward holds: the native engine prefills every admitted prompt
    at once; other engines chunk their prefill (SGLang's default chunk: 16384 tokens)."""
    tokens = rollout_concurrency(run, layout) * run.planner.prompt_tokens
    return tokens if run.rollout.backend == "torch" else min(tokens, 16384)


def rollout_concurrency(run: RunConfig, layout: Layout) -> int:
    r = run.rollout
    per_engine = math.ceil(r.prompts_per_step * r.samples_per_prompt / layout.engines)
    cap = r.options.get("max_batch_size")
    return min(per_engine, int(cap)) if cap else per_engine


def format_plan(p: Plan) -> str:
    """The plan as the table `miles recipes plan` prints."""
    run = p.run
    s = p.shape
    params = s.params
    lines = [
        f"model    {p.model} (family {p.family})",
        f"params   {_count(params.language_model)} loaded"
        + (f" (+{_count(params.vision)} vision, not loaded)" if params.vision else "")
        + (
            f"; {_count(params.language_model - params.experts + s.active_expert_params)} "
            "active per token"
            if params.experts
            else ""
        ),
        f"layout   {p.layout.describe()}",
        f"precision {p.precision}; train backend {run.train.backend}",
    ]
    tokens = run.train.options.get("micro_batch_tokens", "?")
    conc = rollout_concurrency(run, p.layout)
    seq = run.planner.prompt_tokens + run.rollout.max_new_tokens
    prefill = prefill_tokens(run, p.layout)
    rows = [
        ("weights", p.train["weights"], p.rollout["weights"]),
        ("gradients", p.train["gradients"], None),
        ("optimizer state", p.train["optimizer"], None),
        (
            f"activations (train {tokens} tokens/micro-batch; prefill {prefill} tokens)",
            p.train["activations"],
            p.rollout["activations"],
        ),
        (f"KV cache ({conc} seqs x {seq} tokens)", None, p.rollout["kv_cache"]),
        ("total", p.train_total, p.rollout_total),
    ]
    width = max(len(r[0]) for r in rows) + 2
    lines.append("")
    lines.append(f"{'per GPU (GB)':<{width}}{'train':>10}{'rollout':>10}")
    for label, train, rollout in rows:
        lines.append(f"{label:<{width}}{_gb(train):>10}{_gb(rollout):>10}")
    lines.append("")
    if p.usable is None:
        lines.append(f"peak {p.peak / GB:.1f} GB per GPU (no GPU memory given: --gpu-mem 141GB)")
    else:
        verdict = "fits" if p.fits else "DOES NOT FIT"
        lines.append(
            f"peak {p.peak / GB:.1f} GB per GPU of {p.usable / GB:.1f} GB usable "
            f"({p.gpu_mem / GB if p.gpu_mem else 0:.0f} GB x {p.usable_fraction:g}): {verdict}"
        )
        if not p.fits:
            lines.append(advice(p))
    lines += [f"note: {n}" for n in p.notes]
    lines.append("note: activations and KV cache are estimates from the model's widths")
    return "\n".join(lines)


def advice(p: Plan) -> str:
    """What to change when a plan does not fit, from what dominates it."""
    if p.train_total >= p.rollout_total:
        biggest = max(p.train, key=lambda k: p.train[k])
        tips = {
            "activations": "lower train.micro_batch_tokens or set train.activation_checkpointing",
            "weights": "use more train GPUs or more tensor/pipeline/expert parallelism",
            "gradients": "use more train GPUs or more tensor/pipeline/expert parallelism",
            "optimizer": "use more train GPUs (more data parallelism shards the optimizer)",
        }
        return f"train GPUs: most of it is {_LABELS[biggest]}; {tips[biggest]}"
    biggest = max(p.rollout, key=lambda k: p.rollout[k])
    tips = {
        "weights": "raise rollout.gpus_per_engine (engine tensor parallelism)",
        "kv_cache": "lower the rollout concurrency (rollout.max_batch_size) or raise "
        "rollout.gpus_per_engine",
        "activations": "lower the rollout concurrency (rollout.max_batch_size) or "
        "planner.prompt_tokens",
    }
    return f"rollout GPUs: most of it is {_LABELS[biggest]}; {tips[biggest]}"


_LABELS = {
    "weights": "weights",
    "gradients": "gradients",
    "optimizer": "optimizer state",
    "activations": "activations",
    "kv_cache": "the KV cache",
}


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _gb(value: float | None) -> str:
    return "-" if value is None else f"{value / GB:.2f}"


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def parse_memory(text: str) -> float:
    """'141GB', '141 GiB', '80G' or '141' (GB) -> gigabytes (1e9 bytes)."""
    raw = text.strip().lower().replace(" ", "")
    for suffix, factor in (("gib", 2**30 / GB), ("gb", 1.0), ("g", 1.0), ("tb", 1e3)):
        if raw.endswith(suffix):
            raw, scale = raw[: -len(suffix)], factor
            break
    else:
        scale = 1.0
    try:
        value = float(raw) * scale
    except ValueError:
        raise PlanError(f"GPU memory {text!r}: expected a size like 141GB or 80GiB") from None
    if value <= 0:
        raise PlanError(f"GPU memory {text!r} must be positive")
    return value


def local_gpu_memory_gb() -> float | None:
    """This machine's first GPU's memory, or None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return float(torch.cuda.get_device_properties(0).total_memory) / GB
