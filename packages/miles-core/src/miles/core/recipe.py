"""What a recipe component returns: a config, and optionally a step that makes local assets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Recipe:
    """A ready-to-run config.

    `prepare(assets_dir, seed)` may build what the config points at (a tiny model, generated data)
    and returns dotted-key overrides such as ``{"model.path": ...}``. It must be idempotent: a
    resumed run calls it again on the same directory.
    """

    config: dict[str, Any]
    prepare: Callable[[Path, int], dict[str, Any]] | None = None
    description: str = ""
