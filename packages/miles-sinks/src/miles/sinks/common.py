"""What every sink shares: the install check for its backend, and which metric values it logs.

Nothing here imports a backend, so the plugin and the config check stay cheap.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any


def install_command(extra: str) -> str:
    return f"pip install 'miles-sinks[{extra}]'"


def is_installed(module: str) -> bool:
    """Whether `module` is an installed package, without importing it."""
    spec = importlib.util.find_spec(module)
    # A bare folder of that name in the working directory (wandb makes ./wandb) is a namespace
    # package with no origin, not the library.
    return spec is not None and spec.origin is not None


def check_installed(module: str, extra: str) -> None:
    """ValueError (a config error, before launch) when the sink's package is missing."""
    if not is_installed(module):
        raise ValueError(
            f"the {extra} metric sink needs the {module!r} package, which is not installed: "
            f"{install_command(extra)}"
        )


def require(module: str, extra: str) -> ModuleType:
    """Imports the sink's package, or ImportError with the pip command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"the {extra} metric sink needs the {module!r} package ({exc}): "
            f"{install_command(extra)}"
        ) from exc


def scalars(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """The loggable part of one step's metrics: finite numbers by name.

    numpy and torch scalars are unwrapped and bools count as 0/1; None, NaN, infinities, strings
    and anything else are skipped, as is a "step" key (the step is logged as the step).
    """
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if not isinstance(key, str) or key == "step":
            continue
        if hasattr(value, "item") and not isinstance(value, int | float):
            try:
                value = value.item()
            except (TypeError, ValueError, RuntimeError):  # an array of more than one value
                continue
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
            out[key] = value
    return out
