"""Typed specs that registration hooks yield, and the registry that collects them."""

from __future__ import annotations

import difflib
import enum
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from miles.core.config import RunConfig
from miles.core.contracts.memory import PrecisionMemoryModel, RolloutMemoryModel, TrainMemoryModel


class Kind(enum.StrEnum):
    """Every extension kind a plugin can provide."""

    ROLLOUT_BACKEND = "rollout_backend"
    TRAIN_BACKEND = "train_backend"
    ROLLOUT_FUNCTION = "rollout_function"
    ENVIRONMENT = "environment"
    AGENT = "agent"
    REWARD = "reward"
    FILTER = "filter"
    ADVANTAGE = "advantage"
    LOSS = "loss"
    KL = "kl"
    CORRECTION = "correction"
    PRECISION = "precision"
    FAMILY = "family"
    RECIPE = "recipe"
    METRIC_SINK = "metric_sink"


class Capability(enum.StrEnum):
    """What a component can do, declared in its spec. The run checks them before launch and the
    runtime branches on them; nothing in the core tests a component's name."""

    # Train backends: how they split the model over ranks (data parallelism is always there).
    TENSOR_PARALLEL = "tensor_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    EXPERT_PARALLEL = "expert_parallel"
    CONTEXT_PARALLEL = "context_parallel"
    CRITIC = "critic"  # trains a value model beside the policy (for advantages that need values)
    REFERENCE = "reference"  # keeps the initial policy for reference logprobs (a KL term)
    LORA = "lora"  # trains low-rank adapters over a frozen base (the run's `lora` section)
    ROUTING_REPLAY = "routing_replay"  # routes MoE tokens through the experts the rollout chose
    # Train and rollout backends: they give the GPU back to each other (sleep/wake and
    # release/resume memory), so both may share one (placement: colocated).
    COLOCATE = "colocate"
    # Rollout backends.
    ROUTING_RECORD = "routing_record"  # records each token's MoE experts
    QUANTIZED_ROLLOUT = "quantized_rollout"  # takes a quantized precision's synced weights
    LORA_ADAPTERS = (
        "lora_adapters"  # applies synced LoRA adapters to its base (lora.sync: adapters)
    )
    PARTIAL_ROLLOUT = "partial_rollout"  # a pause hands unfinished requests back with their tokens
    SERVER = "server"  # runs as a server of its own (HTTP), which the engine actor drives
    # Precisions.
    QUANTIZED = "quantized"  # a weight format of its own: it converts the training layers, and
    # engines get its quantized weights at every sync (never model.path as it is on disk)
    # Advantage estimators.
    NEEDS_VALUES = "needs_values"  # per-token advantages from a critic's values (gae)
    # Rewards.
    SCORES_GROUPS = "scores_groups"  # scores a whole group in one call (`score_group`)
    # Filters.
    OVERSAMPLES = "oversamples"  # may drop whole groups and ask for extra rounds to refill a step


# What a spec may declare as its memory model, by kind (the planner adds them up).
MemoryModel = TrainMemoryModel | RolloutMemoryModel | PrecisionMemoryModel
# A check of the whole run a component makes before launch (e.g. LoRA targets against the
# model): (the run config, the component's own built config or None) -> problems, each one line.
RunCheck = Callable[[RunConfig, Any], list[str]]


@dataclass(frozen=True)
class ComponentSpec:
    """One named component, as a plugin declares it.

    `factory` builds the component; when `config` is a dataclass type, the component's section of
    the run config is validated against it and the factory receives the instance first.
    `capabilities` say what it can do (see `Capability`), `memory` how much GPU memory it needs
    (train and rollout backends, precisions; see `miles.core.contracts.memory`), and `check` what it must
    see in the run config before launch.
    """

    kind: Kind
    name: str
    factory: Callable[..., Any]
    summary: str
    config: type | None = None
    capabilities: frozenset[Capability] = frozenset()
    memory: MemoryModel | None = None
    check: RunCheck | None = None

    def __post_init__(self) -> None:
        if (
            not self.name
            or not self.name.replace("_", "").replace("-", "").replace(".", "").isalnum()
        ):
            raise ValueError(
                f"invalid component name {self.name!r}: use letters, digits, '_', '-', '.'"
            )
        known = {c.value for c in Capability}
        unknown = sorted(str(c) for c in self.capabilities if str(c) not in known)
        if unknown:
            raise ValueError(
                f"{self.kind} {self.name!r}: unknown capabilities {unknown}; choose from "
                f"{', '.join(sorted(known))}"
            )
        # Plain strings are accepted for convenience and stored as members.
        object.__setattr__(
            self, "capabilities", frozenset(Capability(c) for c in self.capabilities)
        )

    def has(self, capability: Capability) -> bool:
        return capability in self.capabilities


@dataclass(frozen=True)
class Component:
    """A registered component with its provenance."""

    spec: ComponentSpec
    distribution: str
    version: str

    @property
    def kind(self) -> Kind:
        return self.spec.kind

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def provider(self) -> str:
        return f"{self.distribution} {self.version}"


class ComponentNotFoundError(LookupError):
    pass


class ComponentConflictError(RuntimeError):
    pass


class Registry:
    """All components of all loaded plugins, by kind and name."""

    def __init__(self) -> None:
        self._by_kind: dict[Kind, dict[str, Component]] = {kind: {} for kind in Kind}

    def add(self, component: Component) -> None:
        existing = self._by_kind[component.kind].get(component.name)
        if existing is not None:
            raise ComponentConflictError(
                f"{component.kind} {component.name!r} is registered by both {existing.provider} "
                f"and {component.provider}; uninstall one, or turn one off with "
                f"MILES_DISABLE_PLUGINS={component.distribution}"
            )
        self._by_kind[component.kind][component.name] = component

    def get(self, kind: Kind | str, name: str) -> Component:
        kind = Kind(kind)
        found = self._by_kind[kind].get(name)
        if found is None:
            raise ComponentNotFoundError(self.unknown_message(kind, name))
        return found

    def names(self, kind: Kind | str) -> list[str]:
        return sorted(self._by_kind[Kind(kind)])

    def all(self) -> list[Component]:
        return [c for kind in Kind for _, c in sorted(self._by_kind[kind].items())]

    def unknown_message(self, kind: Kind, name: str) -> str:
        names = self.names(kind)
        close = difflib.get_close_matches(name, names, n=3)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        available = ", ".join(names) if names else "none installed"
        return f"unknown {kind} {name!r}{hint} (available: {available})"


def lazy(target: str) -> Callable[..., Any]:
    """A factory that imports ``package.module:attr`` on first call.

    Registration then stays cheap: listing plugins does not import torch or transformers.
    """
    module_name, _, attr = target.partition(":")

    def factory(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module_name), attr)(*args, **kwargs)

    factory.__qualname__ = factory.__name__ = attr
    factory.__doc__ = f"Imports and calls {target}."
    return factory
