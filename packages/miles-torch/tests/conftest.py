"""miles-torch test set-up: tests never reach a model hub; every model is made at test time."""

import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# Set before transformers is first imported, so no test can fall back to a download.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """`tiny_model(arch="qwen3", seed=0, **config_overrides)`: the path of a tiny random
    checkpoint, made once per set of arguments."""
    from miles.torch.testing import make_tiny_model

    @functools.cache
    def make(arch: str = "qwen3", seed: int = 0, **overrides: Any) -> str:
        directory = tmp_path_factory.mktemp(f"{arch}_{seed}")
        return make_tiny_model(directory, arch=arch, seed=seed, **overrides)

    return make


@pytest.fixture
def make_trainer() -> Iterator[Callable[..., Any]]:
    """Builds single-rank FSDP trainers; closes them (and the process group) after the test."""
    from miles.runtime.cluster.process import free_port
    from miles.torch.testing import make_trainer as make_one

    made: list[Any] = []
    port = free_port()

    def make(path: str, **options: Any) -> Any:
        """`options`: FSDPConfig and TrainSetup fields (reference=True, critic=True, ...)."""
        trainer = make_one(path, master_port=port, **options)
        made.append(trainer)
        return trainer

    yield make
    for trainer in reversed(made):
        trainer.close()
