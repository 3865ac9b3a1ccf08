"""Miles core: hookspecs, plugin manager, config, data types, the RL loop and the CLI.

What a plugin author needs is importable from here::

    from miles.core import Capability, ComponentSpec, Kind, hookimpl
"""

from importlib.metadata import PackageNotFoundError, version

from miles.core.components import Capability, Component, ComponentSpec, Kind, lazy
from miles.core.hookspecs import hookimpl

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
