"""The YAML recipes in `configs/`: one file per recipe, named after it.

A recipe file is a plain run config. Its leading comment block is the recipe's description, and
the first line of it is the summary `miles recipes list` shows. Registration reads only that
line, so listing stays cheap; the YAML itself is parsed when the recipe is used.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from importlib import resources
from pathlib import Path

from miles.core import ComponentSpec, Kind
from miles.core.contracts.recipe import Recipe

CONFIGS = Path(str(resources.files("miles.recipes") / "configs"))
# The packages that provide the production backends the frontier recipes name, for the error a
# user sees when they are not installed.
PROVIDERS = {
    "megatron": "the miles-megatron package (the Megatron-core train backend: docs/megatron.md)",
    "sglang": "the miles-sglang package (SGLang rollout: running servers attached by rollout.urls)",
}


def _header(path: Path) -> list[str]:
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.removeprefix("#").removeprefix(" "))
    return lines


def load(path: Path) -> Recipe:
    from miles.core.config import load_yaml

    config = load_yaml(path)
    if config.get("name") != path.stem:
        raise ValueError(f"{path}: name must be {path.stem!r}, the file's name")
    backends = {config.get(s, {}).get("backend") for s in ("train", "rollout")}
    requires = {name: PROVIDERS[name] for name in backends if name in PROVIDERS}
    return Recipe(config=config, description="\n".join(_header(path)).strip(), requires=requires)


def specs(directory: Path = CONFIGS) -> list[ComponentSpec]:
    out = []
    for path in sorted(directory.glob("*.yaml")):
        header = _header(path)
        factory: Callable[[], Recipe] = partial(load, path)
        out.append(ComponentSpec(Kind.RECIPE, path.stem, factory, header[0] if header else ""))
    return out
