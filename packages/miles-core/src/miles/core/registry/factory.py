"""Builds a configured component: looks it up, checks its options, calls its factory."""

from __future__ import annotations

import dataclasses
from typing import Any

from miles.core.config import ComponentRef
from miles.core.config.tools import ConfigError, build
from miles.core.contracts.components import ComponentSpec, Kind
from miles.core.registry.plugins import get_plugin_manager


def build_component(
    kind: Kind,
    ref: ComponentRef | str,
    *args: Any,
    options: dict[str, Any] | None = None,
    path: str = "",
    **kwargs: Any,
) -> Any:
    """``factory(config, *args, **kwargs)`` when the component has a config class, else
    ``factory(*args, **kwargs)``. Options come from the ref, or from `options` for backends."""
    name = ref.name if isinstance(ref, ComponentRef) else ref
    if options is None:
        options = ref.options if isinstance(ref, ComponentRef) else {}
    spec = get_plugin_manager().get(kind, name).spec
    if spec.config is not None:
        return spec.factory(build(spec.config, options, path or str(kind)), *args, **kwargs)
    return spec.factory(*args, **kwargs)


def built_options(spec: ComponentSpec, options: dict[str, Any]) -> Any:
    """The component's config instance from `options` (keys it does not know left out, defaults
    where they are missing), or None for a component without one. ConfigError if they do not
    parse."""
    if spec.config is None:
        return None
    own = {f.name for f in dataclasses.fields(spec.config)}
    return build(spec.config, {k: v for k, v in options.items() if k in own}, str(spec.kind))


def options_with_defaults(kind: Kind, name: str, options: dict[str, Any]) -> dict[str, Any]:
    """A component's options with its config's defaults filled in (as given when the component
    is not installed here, or its options do not parse)."""
    try:
        spec = get_plugin_manager().get(kind, name).spec
    except LookupError:
        return dict(options)
    try:
        built = built_options(spec, options)
    except ConfigError:
        return dict(options)
    if built is None:
        return dict(options)
    return {f.name: getattr(built, f.name) for f in dataclasses.fields(built)}
