"""Typed specs that registration hooks yield, and the registry that collects them."""

from __future__ import annotations

import difflib
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Kind(enum.StrEnum):
    """Every extension kind a plugin can provide."""

    ROLLOUT_BACKEND = "rollout_backend"
    TRAIN_BACKEND = "train_backend"
    ROLLOUT_FUNCTION = "rollout_function"
    ENVIRONMENT = "environment"
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


@dataclass(frozen=True)
class ComponentSpec:
    """One named component, as a plugin declares it.

    `factory` builds the component; when `config` is a dataclass type, the component's section of the
    run config is validated against it and the factory receives the instance. `capabilities` name
    optional features the run checks before launch (a train backend's "tensor_parallel",
    "pipeline_parallel", "expert_parallel", "context_parallel").
    """

    kind: Kind
    name: str
    factory: Callable[..., Any]
    summary: str
    config: type | None = None
    capabilities: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if (
            not self.name
            or not self.name.replace("_", "").replace("-", "").replace(".", "").isalnum()
        ):
            raise ValueError(
                f"invalid component name {self.name!r}: use letters, digits, '_', '-', '.'"
            )


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
        import importlib

        return getattr(importlib.import_module(module_name), attr)(*args, **kwargs)

    factory.__qualname__ = factory.__name__ = attr
    factory.__doc__ = f"Imports and calls {target}."
    return factory
