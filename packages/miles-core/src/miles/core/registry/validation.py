"""Checks a typed run config against the installed plugins, before any worker starts.

Every component name must resolve and its options must fit its config class; what the run asks
for must be what the chosen components declare they can do (`Capability`); each component may
check the whole run its own way (`ComponentSpec.check`). All problems are reported at once, each
starting with its key path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from miles.core.config import ComponentRef, RolloutConfig, RunConfig, TrainConfig, parse_partial
from miles.core.config.tools import ConfigError, build, closest
from miles.core.contracts.components import Capability, ComponentSpec, Kind
from miles.core.contracts.recipe import Recipe
from miles.core.registry.families import notices_for, replay_problem
from miles.core.registry.plugins import get_plugin_manager

log = structlog.get_logger(__name__)

# The embedded default stack the config's defaults name (torch, fsdp, single_turn, exact_match,
# grpo, ppo_clip, fp32), for the hint when a default is missing from a minimal install.
EMBEDDED_DEFAULTS = "miles-torch miles-rollouts miles-rewards miles-losses miles-precision"


@dataclass
class _Resolved:
    """A component the config names, once found: its spec and its built options."""

    spec: ComponentSpec
    options: Any  # an instance of spec.config, or None


class _Checker:
    def __init__(self, config: RunConfig, hints: Mapping[str, str]) -> None:
        self.config, self.hints = config, hints
        self.problems: list[str] = []
        self.resolved: list[_Resolved] = []

    def component(
        self,
        kind: Kind,
        ref: ComponentRef | str,
        path: str,
        options: dict[str, Any] | None = None,
        generic: tuple[str, ...] = (),
    ) -> _Resolved | None:
        """The component's spec and built options, or None (the problem recorded)."""
        name = ref.name if isinstance(ref, ComponentRef) else ref
        if options is None:
            options = ref.options if isinstance(ref, ComponentRef) else {}
        try:
            spec = get_plugin_manager().get(kind, name).spec
        except LookupError as exc:
            self.problems.append(f"{path}: {exc}{self._hint(kind, name)}")
            return None
        built: Any = None
        if spec.config is None:
            if options:
                self.problems.append(
                    f"{path}: {kind} {name!r} takes no options, got {sorted(options)}"
                )
        else:
            own = [f.name for f in dataclasses.fields(spec.config)]
            for key in options:
                if key not in own:
                    accepted = ", ".join([*generic, *own])
                    self.problems.append(
                        f"{path}.{key}: unknown key{closest(key, [*generic, *own])} "
                        f"(accepted here: {accepted})"
                    )
            try:
                built = build(spec.config, {k: v for k, v in options.items() if k in own}, path)
            except ConfigError as exc:
                self.problems.extend(exc.problems)
        found = _Resolved(spec, built)
        self.resolved.append(found)
        return found

    def _hint(self, kind: Kind, name: str) -> str:
        if name in self.hints:
            return f"; {self.hints[name]} provides it"
        if name == _default_name(kind):
            return (
                f"; it is the default {kind}: `pip install {EMBEDDED_DEFAULTS}` gives the defaults"
            )
        return ""

    def require(self, found: _Resolved | None, capability: Capability, path: str, why: str) -> None:
        """`why` (what the run asks for) needs `capability` of the component at `path`."""
        if found is not None and not found.spec.has(capability):
            spec = found.spec
            self.problems.append(
                f"{path}: {why}, but {spec.kind} {spec.name!r} cannot ({capability} is not among "
                f"its capabilities: {', '.join(sorted(spec.capabilities)) or 'none'})"
            )


def _default_name(kind: Kind) -> str | None:
    defaults = RunConfig()
    return {
        Kind.ROLLOUT_BACKEND: defaults.rollout.backend,
        Kind.TRAIN_BACKEND: defaults.train.backend,
        Kind.ROLLOUT_FUNCTION: defaults.rollout.function.name,
        Kind.REWARD: defaults.reward.name,
        Kind.ADVANTAGE: defaults.algorithm.advantage.name,
        Kind.LOSS: defaults.algorithm.loss.name,
        Kind.KL: defaults.algorithm.kl.estimator,
        Kind.PRECISION: defaults.precision.name,
    }.get(kind)


def validate(config: RunConfig, hints: Mapping[str, str] | None = None) -> None:
    """Raises ConfigError naming every problem. `hints` say which package provides a component
    name that may be missing here (a recipe knows what its backends need)."""
    c = _Checker(config, hints or {})
    algo = config.algorithm
    c.component(Kind.ROLLOUT_FUNCTION, config.rollout.function, "rollout.function")
    rollout = c.component(
        Kind.ROLLOUT_BACKEND,
        config.rollout.backend,
        "rollout",
        config.rollout.options,
        _generic_keys(RolloutConfig),
    )
    train = c.component(
        Kind.TRAIN_BACKEND,
        config.train.backend,
        "train",
        config.train.options,
        _generic_keys(TrainConfig),
    )
    c.component(Kind.REWARD, config.reward, "reward")
    for i, f in enumerate(config.filters):
        c.component(Kind.FILTER, f, f"filters[{i}]")
    advantage = c.component(Kind.ADVANTAGE, algo.advantage, "algorithm.advantage")
    if algo.correction is not None:
        c.component(Kind.CORRECTION, algo.correction, "algorithm.correction")
    c.component(Kind.LOSS, algo.loss, "algorithm.loss")
    if advantage is not None and advantage.spec.has(Capability.NEEDS_VALUES):
        c.component(Kind.LOSS, algo.value_loss, "algorithm.value_loss")
    if algo.kl.coef:
        c.component(Kind.KL, algo.kl.estimator, "algorithm.kl.estimator")
    if config.warmstart.steps:
        c.component(Kind.LOSS, config.warmstart.loss, "warmstart.loss")
    precision = c.component(Kind.PRECISION, config.precision, "precision")
    for i, s in enumerate(config.telemetry.sinks):
        c.component(Kind.METRIC_SINK, s, f"telemetry.sinks[{i}]")
    if config.model.family is not None:
        c.component(Kind.FAMILY, config.model.family, "model.family")
    _capabilities(c, train, rollout, advantage, precision)
    c.problems.extend(_run_shape(config))
    replay = replay_problem(config.model.path, config.moe.routing_replay)
    if replay:
        c.problems.append(replay)
    notices = notices_for(config.model.path, config.model.family)
    c.problems.extend(f"model.path: {n.message}" for n in notices if n.fatal)
    if not c.problems:  # a component's own check of the run, once the run itself is sound
        for found in c.resolved:
            if found.spec.check is not None:
                c.problems.extend(found.spec.check(config, found.options))
    if c.problems:
        raise ConfigError(c.problems)


def _capabilities(
    c: _Checker,
    train: _Resolved | None,
    rollout: _Resolved | None,
    advantage: _Resolved | None,
    precision: _Resolved | None,
) -> None:
    """What the run asks of its backends, against what they declare."""
    config = c.config
    parallel = config.train.parallel
    for name in ("tensor", "pipeline", "expert", "context"):
        size = getattr(parallel, name)
        if size > 1:
            c.require(
                train,
                Capability(f"{name}_parallel"),
                f"train.parallel.{name}",
                f"{name} parallelism of {size} was asked for",
            )
    if config.train.world_size % parallel.model_parallel:
        c.problems.append(
            f"train.world_size: {config.train.world_size} is not a multiple of tensor x pipeline "
            f"x context ({parallel.model_parallel})"
        )
    if config.placement == "colocated":
        why = "placement: colocated makes trainer and engines take turns on each GPU"
        c.require(train, Capability.COLOCATE, "train.backend", why)
        c.require(rollout, Capability.COLOCATE, "rollout.backend", why)
    if config.algorithm.kl.coef:
        c.require(
            train, Capability.REFERENCE, "algorithm.kl.coef", "a KL term needs reference logprobs"
        )
    if advantage is not None and advantage.spec.has(Capability.NEEDS_VALUES):
        why = f"advantage {advantage.spec.name!r} needs a critic's values"
        c.require(train, Capability.CRITIC, "algorithm.advantage", why)
    if config.lora is not None:
        c.require(train, Capability.LORA, "lora", "LoRA adapters were asked for")
        if config.lora.sync == "adapters":
            why = "lora.sync: adapters sends only the adapters to the engines"
            c.require(rollout, Capability.LORA_ADAPTERS, "lora.sync", why)
    if config.moe.routing_replay != "off":
        why = f"moe.routing_replay: {config.moe.routing_replay}"
        c.require(train, Capability.ROUTING_REPLAY, "moe.routing_replay", why)
        c.require(rollout, Capability.ROUTING_RECORD, "moe.routing_replay", why)
    if precision is not None and precision.spec.has(Capability.QUANTIZED):
        why = f"precision {precision.spec.name!r} syncs its own quantized weight format"
        c.require(rollout, Capability.QUANTIZED_ROLLOUT, "precision", why)
    if config.mode == "async" and config.async_.on_weight_update == "continue":
        why = "async.on_weight_update: continue finishes paused requests from where they stopped"
        c.require(rollout, Capability.PARTIAL_ROLLOUT, "async.on_weight_update", why)


def _run_shape(config: RunConfig) -> list[str]:
    """Settings that do not fit together, whatever the components."""
    problems = []
    if not config.model.path:
        problems.append("model.path: required (a local Hugging Face checkpoint dir or a hub id)")
    if not config.data.path:
        problems.append("data.path: required (a .jsonl or .parquet file, or a hub dataset id)")
    if config.steps < 0:
        problems.append("steps: must be >= 0")
    outside = [s for s in config.telemetry.profile_steps if not 1 <= s <= config.steps]
    if outside:
        problems.append(
            f"telemetry.profile_steps: {outside} are not steps of this run (1 to "
            f"{config.steps}); list steps from that range"
        )
    algo = config.algorithm
    if config.mode != "sync" and algo.correction is None and algo.old_logprobs != "rollout":
        problems.append(
            f"mode: {config.mode!r} trains on samples generated by older weights, so it needs a "
            "train-inference correction: set algorithm.correction (tis, mis or icepop) or "
            "algorithm.old_logprobs: rollout"
        )
    per_step = config.rollout.prompts_per_step
    if config.mode == "async" and 0 < config.async_.buffer_size < per_step:
        problems.append(
            f"async.buffer_size: {config.async_.buffer_size} groups cannot hold one step's "
            f"{per_step} (rollout.prompts_per_step); raise it, or 0 for the default"
        )
    if config.placement == "colocated":
        if config.mode != "sync":
            problems.append(
                f"placement: colocated engines give the GPUs to the trainer while it trains, so "
                f"rollout cannot overlap training as mode {config.mode!r} needs; use "
                "placement: disaggregated, or mode: sync"
            )
        if config.rollout.gpus_per_engine != 1 or config.rollout.engines > config.train.world_size:
            problems.append(
                "placement: colocated puts engine i on train rank i's GPU: it needs "
                "rollout.gpus_per_engine: 1 and rollout.engines <= train.world_size "
                f"(got {config.rollout.gpus_per_engine} and {config.rollout.engines} > "
                f"{config.train.world_size})"
            )
    if config.warmstart.steps and not config.warmstart.data:
        problems.append("warmstart.data: required when warmstart.steps > 0")
    for path in (config.data.path, config.warmstart.data, config.eval.data):
        if path and _looks_local(path) and not Path(path).exists():
            problems.append(f"{path}: file not found")
    return problems


def _generic_keys(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "options")


def _looks_local(path: str) -> bool:
    return path.startswith(("/", "./", "../")) or path.endswith((".jsonl", ".json", ".parquet"))


def check_config(
    data: dict[str, Any], hints: Mapping[str, str] | None = None, made_later: Sequence[str] = ()
) -> RunConfig:
    """The typed config, or one ConfigError with every problem: bad keys and values, and (with
    the bad values at their defaults) unknown components, their options and what they cannot do.
    Problems of the keys in `made_later` (filled in by a recipe's prepare) are left out."""
    config, problems = parse_partial(data)
    try:
        validate(config, hints)
    except ConfigError as exc:
        problems += [p for p in exc.problems if p not in problems]
    problems = [p for p in problems if p.split(":", 1)[0] not in made_later]
    if problems:
        raise ConfigError(problems)
    for notice in notices_for(config.model.path, config.model.family):
        log.warning("model family notice", notice=notice.message)
    return config


def recipe_problems(recipe: Recipe) -> list[str]:
    """What would stop `miles run RECIPE` here before launch (a component not installed, a
    feature this release lacks, a backend this machine cannot run); [] when none. Checked from
    the config alone: nothing is made or downloaded."""
    try:
        check_config(dict(recipe.config), recipe.requires, made_later=recipe.prepares)
    except ConfigError as exc:
        return list(exc.problems)
    return []
