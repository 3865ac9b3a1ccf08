"""Where actors run: Ray start-up, one placement group, and the actors in its bundles.

Each train rank and each rollout engine gets a bundle of its own: one CPU, plus one GPU per train
rank and `rollout.gpus_per_engine` GPUs per engine on a GPU cluster. The rollout manager only
coordinates and takes no bundle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import structlog

from miles.core.config import RunConfig

log = structlog.get_logger(__name__)


def use_gpus(config: RunConfig) -> bool:
    """GPU bundles wherever the controller sees CUDA (the same image runs every node)."""
    import torch

    return bool(torch.cuda.is_available())


def start_ray(config: RunConfig, address: str | None) -> None:
    """Joins `address`, or starts a local Ray sized for this run."""
    import ray

    if ray.is_initialized():
        return
    common: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,  # actors log to events.jsonl; the console keeps the progress bar
        "configure_logging": False,
    }
    if address:
        ray.init(address=address, **common)
        return
    needed = config.train.world_size + config.rollout.engines
    ray.init(num_cpus=max(os.cpu_count() or 1, needed), **common)


@dataclass
class Placement:
    trainers: list[Any]
    manager: Any
    engines: list[Any]
    group: Any

    @classmethod
    def create(cls, config: RunConfig, run_dir: str) -> Placement:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from miles.core.runtime.engine_actor import EngineActor
        from miles.core.runtime.rollout_manager import RolloutManager
        from miles.core.runtime.train_actor import TrainActor

        gpus = use_gpus(config)
        n_train, n_engines = config.train.world_size, config.rollout.engines
        train_bundle = {"CPU": 1, **({"GPU": 1} if gpus else {})}
        engine_bundle = {"CPU": 1, **({"GPU": config.rollout.gpus_per_engine} if gpus else {})}
        bundles = [train_bundle] * n_train + [engine_bundle] * n_engines
        _check_capacity(bundles)
        group = placement_group(bundles, strategy="PACK")
        ray.get(group.ready(), timeout=300)

        def at(index: int, bundle: dict[str, int]) -> dict[str, Any]:
            return {
                "num_cpus": bundle["CPU"],
                "num_gpus": bundle.get("GPU", 0),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, index),
            }

        # On CPU, give each actor its share of cores so they do not oversubscribe the machine.
        threads = None if gpus else max(1, (os.cpu_count() or 1) // (n_train + n_engines))
        device = "cuda" if gpus else "cpu"
        rollout_options = dict(config.rollout.options)
        rollout_options.setdefault("dtype", rollout_dtype(config))
        # The trainers' rendezvous lives where rank 0 will run: ask a task in rank 0's bundle.
        probe = ray.remote(_address).options(**at(0, {"CPU": 0}))
        master_addr, master_port = ray.get(probe.remote())
        trainers: list[Any] = [
            ray.remote(TrainActor)
            .options(**at(rank, train_bundle))
            .remote(
                rank=rank,
                world_size=n_train,
                master_addr=master_addr,
                master_port=master_port,
                config=config,
                run_dir=run_dir,
                device=device,
                num_threads=threads,
            )
            for rank in range(n_train)
        ]
        engines: list[Any] = [
            ray.remote(EngineActor)
            .options(**at(n_train + i, engine_bundle))
            .remote(
                index=i,
                backend=config.rollout.backend,
                options=rollout_options,
                model_path=config.model.path,
                device=device,
                seed=config.seed,
                run_dir=run_dir,
                num_threads=threads,
            )
            for i in range(n_engines)
        ]
        manager: Any = (
            ray.remote(RolloutManager).options(num_cpus=0).remote(config, run_dir, engines)
        )
        # Surface constructor errors (bad checkpoint, missing file) here, not at the first step.
        ray.get([e.health.remote() for e in engines] + [manager.get_state.remote()])
        ray.get([t.flush.remote() for t in trainers])
        return cls(trainers=trainers, manager=manager, engines=engines, group=group)


def _check_capacity(bundles: list[dict[str, int]]) -> None:
    """Fails at once, not after a placement time-out, when the cluster is too small."""
    import ray

    have = ray.cluster_resources()  # type: ignore[no-untyped-call]
    for resource in ("CPU", "GPU"):
        need = sum(b.get(resource, 0) for b in bundles)
        if need > have.get(resource, 0):
            raise RuntimeError(
                f"this run needs {need} {resource}s (train.world_size + rollout.engines x "
                f"rollout.gpus_per_engine), but the Ray cluster has {have.get(resource, 0):g}; "
                "lower train.world_size or rollout.engines, or add nodes"
            )


def rollout_dtype(config: RunConfig) -> str:
    """Engines hold weights in the run's precision: no manual conversion."""
    from miles.core.components import Kind
    from miles.core.factory import build_component

    precision = build_component(Kind.PRECISION, config.precision, path="precision")
    dtype = getattr(precision, "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "float32"


def _address() -> tuple[str, int]:
    from miles.core.runtime.process import free_port, node_address

    return node_address(), free_port()
