"""Where actors run: Ray start-up, one placement group, and the actors in its bundles.

disaggregated: each train rank gets a bundle (one CPU, plus one GPU on a GPU cluster) and each
engine a bundle of its own (one CPU, plus `rollout.gpus_per_engine` GPUs, which Ray keeps on one
node). colocated: one bundle per train rank, and engine i shares rank i's bundle, each actor taking
half of it. Bundles are handed out in (node, GPU) order (`bundles.assign`), so train ranks fill a
node before the next. The rollout manager only coordinates and takes no bundle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import structlog

from miles.core.config import RunConfig
from miles.core.plugins import get_plugin_manager
from miles.core.routing import record_mode
from miles.core.runtime.engine_pool import EngineLauncher

log = structlog.get_logger(__name__)


def use_gpus(config: RunConfig) -> bool:
    """GPU bundles wherever the controller sees CUDA (the same image runs every node)."""
    import torch

    return bool(torch.cuda.is_available())


def start_ray(config: RunConfig, address: str | None) -> None:
    """Joins `address`, or starts a local Ray sized for this run.

    `miles run` turns Ray's token authentication on for a local Ray (see `runner`): every
    connection must present the token Ray keeps in ~/.ray/auth_token.
    """
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
    # "local": a new Ray of our own, even when a `ray start` cluster runs on this machine
    # (joining one is what --ray-address is for).
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, needed), **common)
    log.info(
        "local Ray started",
        address=ray.get_runtime_context().gcs_address,
        auth=os.environ.get("RAY_AUTH_MODE", "disabled"),
    )


@dataclass
class TrainLauncher:
    """Starts the train group in its bundles (again after a failure, with a new rendezvous)."""

    group: Any
    bundles: list[int]  # bundle index of rank r
    num_cpus: float
    num_gpus: float
    kwargs: dict[str, Any]  # TrainActor's keyword arguments, except rank and the rendezvous

    def launch(self) -> list[Any]:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from miles.core.runtime.train_actor import TrainActor

        def at(bundle: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(self.group, bundle)

        # The rendezvous lives where rank 0 will run: ask a task in rank 0's bundle.
        probe = ray.remote(_address).options(num_cpus=0, scheduling_strategy=at(self.bundles[0]))
        master_addr, master_port = ray.get(probe.remote())
        return [
            ray.remote(TrainActor)
            .options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=at(b))
            .remote(
                rank=rank,
                world_size=len(self.bundles),
                master_addr=master_addr,
                master_port=master_port,
                **self.kwargs,
            )
            for rank, b in enumerate(self.bundles)
        ]


@dataclass
class Placement:
    trainers: list[Any]
    manager: Any
    engines: list[Any]
    group: Any
    train_launcher: TrainLauncher
    colocated: bool
    gpus: bool
    engine_dtype: str  # what the engines hold their weights in

    @classmethod
    def create(cls, config: RunConfig, run_dir: str) -> Placement:
        import ray
        from ray.util.placement_group import placement_group

        from miles.core.runtime.bundles import assign, probe_bundles
        from miles.core.runtime.rollout_manager import RolloutManager

        gpus = use_gpus(config)
        colocated = config.placement == "colocated"
        n_train, n_engines = config.train.world_size, config.rollout.engines
        train_bundle = {"CPU": 1, **({"GPU": 1} if gpus else {})}
        engine_bundle = {"CPU": 1, **({"GPU": config.rollout.gpus_per_engine} if gpus else {})}
        if colocated:
            bundles, kinds = [train_bundle] * n_train, ["train"] * n_train
        else:
            bundles = [train_bundle] * n_train + [engine_bundle] * n_engines
            kinds = ["train"] * n_train + ["engine"] * n_engines
        _check_capacity(bundles)
        group = placement_group(bundles, strategy="PACK")
        ray.get(group.ready(), timeout=300)
        train_at, engine_at = assign(probe_bundles(group), kinds)  # type: ignore[arg-type]
        if colocated:
            engine_at = train_at[:n_engines]  # engine i shares train rank i's GPU
        share = 0.5 if colocated else 1.0
        log.info(
            "placement", mode=config.placement, train_bundles=train_at, engine_bundles=engine_at
        )

        # On CPU, give each actor its share of cores so they do not oversubscribe the machine.
        threads = None if gpus else max(1, (os.cpu_count() or 1) // (n_train + n_engines))
        device = "cuda" if gpus else "cpu"
        rollout_options = dict(config.rollout.options)
        rollout_options.setdefault("dtype", rollout_dtype(config))
        record = record_mode(get_plugin_manager(), config.model.path, config.moe.routing_replay)
        if record != "off":
            rollout_options.setdefault("record_routing", record)
        train_launcher = TrainLauncher(
            group,
            train_at,
            num_cpus=share,
            num_gpus=share if gpus else 0,
            kwargs={"config": config, "run_dir": run_dir, "device": device, "num_threads": threads},
        )
        trainers = train_launcher.launch()
        engine_launcher = EngineLauncher(
            group,
            engine_at,
            num_cpus=share,
            num_gpus=(share if colocated else config.rollout.gpus_per_engine) if gpus else 0,
            kwargs={
                "backend": config.rollout.backend,
                "options": rollout_options,
                "model_path": config.model.path,
                "device": device,
                "seed": config.seed,
                "run_dir": run_dir,
                "num_threads": threads,
                "sync_timeout_s": config.fault.request_timeout_s,
                "precision": config.precision,
                "lora": config.lora,
            },
        )
        engines = [engine_launcher.launch(i) for i in range(n_engines)]
        manager: Any = (
            ray.remote(RolloutManager)
            .options(num_cpus=0)
            .remote(config, run_dir, engines, engine_launcher)
        )
        # Surface constructor errors (bad checkpoint, missing file) here, not at the first step.
        ray.get([e.health.remote() for e in engines] + [manager.weight_versions.remote()])
        ray.get([t.flush.remote() for t in trainers])
        dtype = str(rollout_options["dtype"])
        return cls(trainers, manager, engines, group, train_launcher, colocated, gpus, dtype)


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


def quantizes(precision: Any) -> bool:
    """A precision with its own weight format (fp8, int4...): it converts the training model's
    layers, and engines without its kernel decode what a sync sends."""
    return hasattr(precision, "rollout_decoder")


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
