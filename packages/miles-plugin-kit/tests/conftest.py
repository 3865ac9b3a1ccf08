"""Fixtures for the kit's tests (the `plant` fixture is suite-wide, in the root conftest.py): load
only chosen plugins (always this kit, whose commands are under test)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from miles.core.registry import plugins

PlantFn = Callable[..., str]  # the suite-wide `plant` fixture (conftest.py at the root)
OnlyFn = Callable[..., None]

KIT = "miles-plugin-kit"


@pytest.fixture
def only(monkeypatch: pytest.MonkeyPatch) -> OnlyFn:
    """Loads only the core, this kit and the named distributions (MILES_LOAD_PLUGINS), from a
    fresh process-wide plugin manager; `miles plugins new` and `check` come from the kit."""

    def _only(*dists: str) -> None:
        monkeypatch.setattr(plugins, "_manager", None)
        monkeypatch.setenv("MILES_LOAD_PLUGINS", ",".join([KIT, *dists]))

    return _only
