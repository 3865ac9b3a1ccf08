"""The memory and placement planner: what one GPU holds for a run config, before anything starts.

Per train GPU: weights, gradients and optimizer state, and activations of one micro-batch; per
rollout GPU: the engine's weights, the KV cache of its concurrency and its prefill working set.
The numbers come from the memory models the train backend, the rollout backend and the precision
declare in their specs (`miles.core.contracts.memory`); a component not installed here is sized by core's
generic estimate, and the plan says so. Parameter counts are exact (each family's `shape`, tested
against transformers).

`miles recipes plan NAME --gpus N --gpu-mem 141GB` prints a plan (`plan_table`); `miles run`
refuses a layout whose plan does not fit, before launch. Torch-free: it sizes a trillion-parameter model from its
config.json alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, cast

from miles.core.config import RunConfig
from miles.core.config.tools import ConfigError
from miles.core.contracts.components import ComponentSpec, Kind
from miles.core.contracts.family import ModelFamily, ModelShape
from miles.core.contracts.memory import (
    GENERIC_PRECISION,
    Layout,
    PrecisionBytes,
    PrecisionMemoryModel,
    RolloutBytes,
    RolloutInputs,
    RolloutMemoryModel,
    TrainBytes,
    TrainInputs,
    TrainMemoryModel,
    generic_rollout,
    generic_train,
    layout_of,
)
from miles.core.registry.factory import built_options
from miles.core.registry.families import family_named, family_of_config, model_config
from miles.core.registry.plugins import get_plugin_manager
from miles.runtime.planning.generic_shape import generic_decoder_shape

GB = 1e9
GENERIC_FAMILY = "(generic dense decoder)"


@dataclass(frozen=True)
class Plan:
    """Bytes per GPU, by what holds them."""

    run: RunConfig
    model: str
    family: str
    shape: ModelShape
    layout: Layout
    train: TrainBytes
    rollout: RolloutBytes
    gpu_mem: float | None  # bytes; None: not known, nothing to check against
    usable_fraction: float
    notes: tuple[str, ...]

    @property
    def train_total(self) -> float:
        return sum(self.train.rows.values())

    @property
    def rollout_total(self) -> float:
        return sum(self.rollout.rows.values())

    @property
    def offloads(self) -> bool:
        """Colocated: whether the hand-over moves memory off the GPU (`offload`). With `auto`,
        only when the trainer and the engines do not fit on a GPU together, or when the GPU's
        memory is not known."""
        if not self.layout.colocated:
            return False
        if self.run.offload != "auto":
            return self.run.offload == "always"
        return self.usable is None or self.train_total + self.rollout_total > self.usable

    @property
    def peak(self) -> float:
        """The most one GPU holds: a train GPU or a rollout GPU. Colocated, the two share a GPU:
        when the hand-over offloads, they take turns (the larger of the two again); when it
        does not, both stay (the sum)."""
        if self.layout.colocated and not self.offloads:
            return self.train_total + self.rollout_total
        return max(self.train_total, self.rollout_total)

    @property
    def usable(self) -> float | None:
        return None if self.gpu_mem is None else self.gpu_mem * self.usable_fraction

    @property
    def fits(self) -> bool | None:
        return None if self.usable is None else self.peak <= self.usable

    def to_json(self) -> dict[str, Any]:
        params = self.shape.params
        return {
            "model": self.model,
            "family": self.family,
            "params": dataclasses.asdict(params)
            | {"language_model": params.language_model, "total": params.total},
            "layout": dataclasses.asdict(self.layout)
            | {"data_parallel": self.layout.data_parallel},
            "precision": self.run.precision.name,
            "train_gb": {k: v / GB for k, v in self.train.rows.items()},
            "rollout_gb": {k: v / GB for k, v in self.rollout.rows.items()},
            "peak_gb": self.peak / GB,
            "offloads": self.offloads,
            "gpu_mem_gb": None if self.gpu_mem is None else self.gpu_mem / GB,
            "usable_gb": None if self.usable is None else self.usable / GB,
            "fits": self.fits,
            "notes": list(self.notes),
        }


class PlanError(ValueError):
    """The config cannot be planned: an impossible layout, or a model that cannot be sized."""


class UnsizedModel(PlanError):
    """Nothing here knows the model's architecture (no config.json, no family with a shape)."""


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
    *,
    gpus: int | None = None,
    gpu_mem_gb: float | None = None,
    hf_config: dict[str, Any] | None = None,
) -> Plan:
    """The plan of `run` (optionally re-laid-out on `gpus` GPUs of `gpu_mem_gb` each).
    `hf_config`: the model's config.json, for a model not made yet (else read at model.path)."""
    found = (hf_config, family_of_config(hf_config)) if hf_config else model_config(run.model.path)
    if found is None:
        raise UnsizedModel(
            f"model.path {run.model.path!r}: no config.json there, and no installed family knows "
            "this checkpoint id; download the checkpoint (or its config.json) and point "
            "model.path at it"
        )
    config, family = found
    if run.model.family is not None:
        family = family_named(run.model.family)
    layout = layout_of(run)
    if gpus is not None:
        layout = rescale(layout, gpus)
    problems = layout_problems(layout, family, config)
    if problems:
        raise PlanError("; ".join(problems))
    notes: list[str] = []
    shape = _shape(config, family, notes)
    try:
        return _plan(run, family, shape, layout, gpu_mem_gb, notes)
    except ConfigError as exc:
        raise PlanError("; ".join(exc.problems)) from None


def _shape(config: dict[str, Any], family: ModelFamily | None, notes: list[str]) -> ModelShape:
    """The family's exact sizes, or a plain dense decoder's estimate when no family covers it."""
    model_type = config.get("model_type")
    if family is None or family.shape is None:
        shape = generic_decoder_shape(config)
        if shape is None:
            raise UnsizedModel(
                f"no installed model family can size model_type {model_type!r}, and it is not "
                "a plain dense decoder; install miles-recipes, or add a family with a `shape` "
                "(see docs/contributing.md)"
            )
        notes.append(
            f"no installed family covers model_type {model_type!r}: sized as a plain dense "
            "decoder from its config.json (parameter counts are estimates too)"
        )
        return shape
    try:
        return family.shape(config)
    except Exception as exc:  # a plugin's arithmetic on a config it did not expect
        raise PlanError(
            f"model family {family.name!r} cannot size this config.json: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _plan(
    run: RunConfig,
    family: ModelFamily | None,
    shape: ModelShape,
    layout: Layout,
    gpu_mem_gb: float | None,
    notes: list[str],
) -> Plan:
    precision = _precision_bytes(run, notes)
    train = _train_bytes(
        run,
        TrainInputs(
            shape=shape,
            layout=layout,
            compute_bytes=precision.compute,
            lora=run.lora is not None,
            reference=run.algorithm.kl.coef > 0,
        ),
        notes,
    )
    r = run.rollout
    rollout = _rollout_bytes(
        run,
        RolloutInputs(
            shape=shape,
            layout=layout,
            compute_bytes=precision.compute,
            weight_bytes=precision.rollout_weights,
            requests_per_step=r.prompts_per_step * r.samples_per_prompt,
            prompt_tokens=run.planner.prompt_tokens,
            max_new_tokens=r.max_new_tokens,
        ),
        notes,
    )
    mem_gb = gpu_mem_gb if gpu_mem_gb is not None else run.planner.gpu_mem_gb
    return Plan(
        run=run,
        model=run.model.path,
        family=family.name if family is not None else GENERIC_FAMILY,
        shape=shape,
        layout=layout,
        train=train,
        rollout=rollout,
        gpu_mem=None if mem_gb is None else mem_gb * GB,
        usable_fraction=run.planner.usable_fraction,
        notes=(*notes, *train.notes, *rollout.notes),
    )


def _spec(kind: Kind, name: str) -> ComponentSpec | None:
    try:
        return get_plugin_manager().get(kind, name).spec
    except LookupError:
        return None


def _precision_bytes(run: RunConfig, notes: list[str]) -> PrecisionBytes:
    spec = _spec(Kind.PRECISION, run.precision.name)
    if spec is None or spec.memory is None:
        notes.append(f"precision {run.precision.name!r} has no memory model here: sized as bf16")
        return GENERIC_PRECISION
    model = cast(PrecisionMemoryModel, spec.memory)
    return model(built_options(spec, run.precision.options))


def _train_bytes(run: RunConfig, inputs: TrainInputs, notes: list[str]) -> TrainBytes:
    name, options = run.train.backend, run.train.options
    spec = _spec(Kind.TRAIN_BACKEND, name)
    if spec is None or spec.memory is None:
        why = "is not installed here" if spec is None else "declares no memory model"
        notes.append(
            f"train backend {name!r} {why}: sized with the generic model-parallel estimate"
        )
        return generic_train(inputs, options)
    train_model = cast(TrainMemoryModel, spec.memory)
    return train_model(inputs, built_options(spec, options))


def _rollout_bytes(run: RunConfig, inputs: RolloutInputs, notes: list[str]) -> RolloutBytes:
    name, options = run.rollout.backend, run.rollout.options
    spec = _spec(Kind.ROLLOUT_BACKEND, name)
    if spec is None or spec.memory is None:
        why = "is not installed here" if spec is None else "declares no memory model"
        notes.append(f"rollout backend {name!r} {why}: sized as an engine with chunked prefill")
        return generic_rollout(inputs, options)
    rollout_model = cast(RolloutMemoryModel, spec.memory)
    return rollout_model(inputs, built_options(spec, options))


def colocated_offload(config: RunConfig, gpu_mem_gb: float | None) -> tuple[bool, str]:
    """Whether a colocated run's hand-over offloads, and why (for the log). Without a known GPU
    (a CPU run) `auto` keeps the hand-over as it always was: it moves nothing there."""
    if config.offload != "auto":
        return config.offload == "always", f"offload: {config.offload}"
    if gpu_mem_gb is None:
        return True, "no GPU memory known"
    try:
        p = plan(config, gpu_mem_gb=gpu_mem_gb)
    except PlanError as exc:
        return True, f"no memory plan ({exc})"
    together = (p.train_total + p.rollout_total) / GB
    usable = (p.usable or 0) / GB
    if p.offloads:
        return True, f"trainer + engines need {together:.1f} GB, over the {usable:.1f} GB usable"
    return False, f"trainer + engines need {together:.1f} GB of the {usable:.1f} GB usable"
