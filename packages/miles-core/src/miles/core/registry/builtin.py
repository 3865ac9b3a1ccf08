"""miles-core's own plugin: it registers through the ``miles`` entry point like any other."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable

from miles.core.contracts.components import Capability, ComponentSpec, Kind
from miles.core.contracts.hookspecs import hookimpl
from miles.core.registry.jsonl_sink import JsonlSink


@hookimpl
def miles_register_metric_sinks() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.METRIC_SINK, "jsonl", JsonlSink, "one JSON line per step in metrics.jsonl"
        ),
    ]


@hookimpl(trylast=True)
def miles_resolve_component(kind: Kind, name: str) -> ComponentSpec | None:
    """``package.module:attr`` names one-off code: a ComponentSpec, a class (built with no
    arguments), or a function, which is the component itself (e.g. an async reward function)."""
    if ":" not in name:
        return None
    module_name, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise LookupError(f"cannot import {kind} {name!r}: {exc}") from exc
    if isinstance(obj, ComponentSpec):
        if obj.kind != kind:
            raise LookupError(f"{name!r} is a {obj.kind}, not a {kind}")
        return obj
    if not callable(obj):
        raise LookupError(f"{name!r} is neither a ComponentSpec nor callable")
    summary = (obj.__doc__ or "").strip().splitlines()[0] if obj.__doc__ else name
    factory = obj if inspect.isclass(obj) else (lambda: obj)
    # One-off code has no spec to declare in: a reward class with `score_group` scores groups.
    group = (
        kind == Kind.REWARD and inspect.isclass(obj) and callable(getattr(obj, "score_group", None))
    )
    capabilities = frozenset({Capability.SCORES_GROUPS}) if group else frozenset()
    return ComponentSpec(kind, attr, factory, summary, capabilities=capabilities)
