"""`miles serve` as a real process on 127.0.0.1, driven over real HTTP (`miles.serve.fixtures`),
and what this package's OpenAI tests share: a module's paged server with a 160-token context,
and transformers' own model to check its numbers against."""

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.serve.fixtures import model, serve_process, serve_process_for_module, server

__all__ = ["model", "paged", "reference", "serve_process", "serve_process_for_module", "server"]

PAGED_CONTEXT = 160


@pytest.fixture(scope="module")
def paged(
    model: str, tmp_path_factory: pytest.TempPathFactory, serve_process_for_module: Any
) -> Iterator[Any]:
    """A module's `miles serve` on the engine's paged path, `PAGED_CONTEXT` tokens of context."""
    start_server, stop_server = serve_process_for_module
    started = start_server(
        model, tmp_path_factory.mktemp("serve-paged"), "--engine-path", "paged",
        "--context-length", str(PAGED_CONTEXT),
    )  # fmt: skip
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def reference(model: str) -> Any:
    """transformers' forward of the served model, in float32."""
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
