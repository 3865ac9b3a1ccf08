"""Miles plugin kit: `miles plugins new` (scaffold a plugin package to publish) and
`miles plugins check` (reward conformance checks), for plugin authors.

:mod:`miles.plugin_kit.conformance` holds the checks, :mod:`miles.plugin_kit.scaffold` the
scaffolder and its templates.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("miles-plugin-kit")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0"

__all__ = ["__version__"]
