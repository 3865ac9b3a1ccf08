"""Plugin sources for plugin-loading tests; the `plant` fixture is suite-wide (root conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

PlantFn = Callable[..., str]  # the suite-wide `plant` fixture (conftest.py at the root)


REWARD_PLUGIN = """
from miles.core import ComponentSpec, Kind, hookimpl

def score(response, sample):
    return 1.0

@hookimpl
def miles_register_rewards():
    return [ComponentSpec(Kind.REWARD, "{name}", score, "always one")]
"""
