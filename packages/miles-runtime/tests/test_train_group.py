"""A train group call tells a dead rank from a rank's own error, whichever arrives first."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from miles.core.config import FaultConfig
from miles.runtime.actors.train_group import TrainerDied, TrainGroup


class Rank:
    """Rank 0 raises at once what a collective raises when its peer is gone; rank 1 dies
    (`peer_dies`) a moment later, or raises its own error."""

    def __init__(self, rank: int, peer_dies: bool) -> None:
        self.rank, self.peer_dies = rank, peer_dies

    def train(self, batch: Any, step: int, trace: dict[str, str]) -> None:
        if self.rank == 0:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
        time.sleep(0.5)
        if self.peer_dies:
            os._exit(1)
        raise RuntimeError("rank 1's own error")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    yield
    ray.shutdown()


def _group(peer_dies: bool) -> TrainGroup:
    actor: Any = ray.remote(Rank).options(num_cpus=0, max_restarts=0)
    ranks = [actor.remote(r, peer_dies) for r in range(2)]
    return TrainGroup(launcher=None, trainers=ranks, fault=FaultConfig())  # type: ignore[arg-type]


def test_a_live_ranks_error_after_a_peers_death_is_the_death(local_ray: None) -> None:
    with pytest.raises(TrainerDied, match="ActorDiedError"):
        _group(peer_dies=True).train(ray.put(None), 0, {})


def test_a_ranks_own_error_is_raised_as_it_is(local_ray: None) -> None:
    with pytest.raises(ray.exceptions.RayTaskError, match="Connection closed by peer"):
        _group(peer_dies=False).train(ray.put(None), 0, {})
