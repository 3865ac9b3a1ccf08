"""miles-recipes' plugin module: the components it registers."""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import ComponentSpec, Kind, hookimpl
from miles.recipes.quickstart import quickstart


@hookimpl
def miles_register_recipes() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.RECIPE,
            "quickstart",
            quickstart,
            "tiny Qwen3 learns 'say the largest number' by GRPO on a 2-core CPU in minutes",
        ),
    ]
