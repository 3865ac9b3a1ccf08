"""The config.json of each real checkpoint the families were written against.

One file per checkpoint, `<org>__<name>.json`: {"checkpoint", "source", "config"}. They let
`miles recipes plan` size a model from its hub id without downloading it, and the family tests
check every family's parameter count against transformers on these exact configs.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

DIRECTORY = Path(str(resources.files("miles.recipes.architectures")))


def file_for(checkpoint: str) -> Path:
    return DIRECTORY / (checkpoint.replace("/", "__") + ".json")


@cache
def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def config_for(checkpoint: str) -> dict[str, Any] | None:
    """The checkpoint's config.json, or None if it is not one of ours."""
    path = file_for(checkpoint)
    if not path.is_file():
        return None
    config: dict[str, Any] = copy.deepcopy(_read(path)["config"])  # transformers edits nested
    return config


def known() -> list[str]:
    """Every checkpoint id with a stored config."""
    return sorted(_read(p)["checkpoint"] for p in DIRECTORY.glob("*.json"))
