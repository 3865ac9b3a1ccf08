"""Builds a configured component: looks it up, checks its options, calls its factory."""

from __future__ import annotations

from typing import Any

from miles.core.components import Kind
from miles.core.config import ComponentRef
from miles.core.configtools import build
from miles.core.plugins import get_plugin_manager


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
