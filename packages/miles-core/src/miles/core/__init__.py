"""Miles core: the contracts a plugin implements, the config schema, the plugin registry and the
`miles` CLI. Grouped by layer: `contracts` (hookspecs, component specs, protocols, data types),
`config`, `registry` (discovery, lookup, validation), `observability` (spans and logs). The loop
and its Ray orchestration are miles-runtime's (`miles.runtime`).

What a plugin author needs is importable from here::

    from miles.core import Capability, ComponentSpec, Kind, hookimpl
"""

from importlib.metadata import PackageNotFoundError, version

from miles.core import _moved
from miles.core.contracts.components import Capability, Component, ComponentSpec, Kind, lazy
from miles.core.contracts.hookspecs import hookimpl

_moved.install()  # the pre-0.1 import paths, with a DeprecationWarning

try:
    __version__ = version("miles-core")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = [
    "Capability",
    "Component",
    "ComponentSpec",
    "Kind",
    "__version__",
    "hookimpl",
    "lazy",
]
