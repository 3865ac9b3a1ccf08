"""pytest fixtures over `miles.serve.testing` (a tiny model, a module's server, the start/stop
pair), for the test suites of miles-serve and of its clients. Imported by a conftest.py only:
pytest is a test dependency, not one of miles-serve's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from miles.serve.testing import Server, start_server, stop_server


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from miles.torch.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", vocab_size=128)


@pytest.fixture(scope="module")
def server(model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    started = start_server(model, tmp_path_factory.mktemp("serve"))
    yield started
    stop_server(started)


@pytest.fixture
def serve_process() -> tuple[Any, Any]:
    """(start_server, stop_server), for a test that starts its own server."""
    return start_server, stop_server


@pytest.fixture(scope="module")
def serve_process_for_module() -> tuple[Any, Any]:
    """(start_server, stop_server), for a module's own server fixture."""
    return start_server, stop_server
