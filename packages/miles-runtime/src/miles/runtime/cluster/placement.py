"""Where actors run: Ray start-up, one placement group, and the actors in its bundles.

disaggregated: each train rank gets a bundle (one CPU, plus one GPU on a GPU cluster) and each
engine a bundle of its own (one CPU, plus `rollout.gpus_per_engine` GPUs, which Ray keeps on one
node). colocated: one bundle per train rank, and engine i shares rank i's bundle, each actor taking
half of it. Bundles are handed out in (topology group, node, GPU) order (`bundles.assign`), so
train ranks fill a node, then a group, before the next; the layout is logged and kept in
manifest.json. The engine group and the rollout manager only coordinate and take no bundle.
Whether bundles get GPUs is the cluster's answer (its resources), never the controller's: a
driver on a CPU-only head node or a laptop runs a GPU cluster's GPUs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import ray
import structlog
from ray import ObjectRef
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table
from ray.util.scheduling_strategies import (
    NodeAffinitySchedulingStrategy,
    PlacementGroupSchedulingStrategy,
)

from miles.core.config import ReplayMode, RunConfig
from miles.core.contracts.components import Capability, Kind
from miles.core.registry.families import record_mode
from miles.core.registry.plugins import get_plugin_manager
from miles.runtime.actors.engine_actor import (
    CONTROL_CONCURRENCY,
    EngineHandle,
    engine_actor_class,
)
from miles.runtime.actors.engine_group import EngineGroup, EngineGroupHandle
from miles.runtime.actors.train_actor import TrainActor, TrainHandle
from miles.runtime.cluster.bundles import BundleInfo, assign, probe_bundles
from miles.runtime.cluster.process import free_port, kill_actor, node_address, node_id
from miles.runtime.planning.gpu_memory import local_gpu_memory_gb
from miles.runtime.rollout.rollout_manager import RolloutHandle, RolloutManager
from miles.runtime.rundir import add_to_manifest

log = structlog.get_logger(__name__)


def use_gpus(device: str = "auto") -> bool:
    """GPU bundles when the Ray cluster has GPUs (`cluster.device`): the controller itself needs
    no CUDA, so a driver on a CPU-only head node or a laptop drives a GPU cluster."""
    have = ray.cluster_resources().get("GPU", 0)  # type: ignore[no-untyped-call]
    if device == "cuda" and not have:
        raise RuntimeError(
            "cluster.device=cuda, but the Ray cluster has no GPUs: start the GPU nodes "
            "(`ray start --address=HEAD:PORT` on each; Ray finds their GPUs), or set "
            "cluster.device=auto to run on CPUs"
        )
    return bool(have) and device != "cpu"


def cluster_gpu_memory_gb() -> float | None:
    """One GPU's memory, asked on a node that has GPUs (the driver's node may have none); None
    on a cluster without GPUs."""
    alive = ray.nodes()  # type: ignore[no-untyped-call]
    nodes = [n for n in alive if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
    if not nodes:
        return None
    there = NodeAffinitySchedulingStrategy(nodes[0]["NodeID"], soft=False)
    probe = ray.remote(local_gpu_memory_gb).options(num_cpus=0, scheduling_strategy=there)
    memory: float | None = ray.get(probe.remote(), timeout=120)
    return memory


def start_ray(config: RunConfig, address: str | None) -> None:
    """Joins `address`, or starts a local Ray sized for this run.

    `miles run` turns Ray's token authentication on for a local Ray (see `cli.run`): every
    connection must present the token Ray keeps in ~/.ray/auth_token.
    """
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


class NoPlaceError(RuntimeError):
    """A lost node's bundles found no place on the nodes left within fault.node_wait_s."""


def wait_for_places(group: PlacementGroup, timeout_s: float) -> None:
    """Returns once every bundle of `group` is placed on a live node. After a node dies, Ray
    re-places its bundles on the others when they have room (or on a node that joins); actors
    started in a bundle without a place would only wait, so wait here, with a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        table = placement_group_table(group)
        if table.get("state") == "CREATED":
            return
        if time.monotonic() > deadline:
            needs = [b for i, b in enumerate(group.bundle_specs) if i not in _placed(table)]
            raise NoPlaceError(
                f"a node was lost and its bundles ({needs}) found no place on the nodes left "
                f"within fault.node_wait_s={timeout_s:g}s: add a node with those resources, or "
                "raise fault.node_wait_s"
            )
        time.sleep(0.5)


def _placed(table: dict[str, Any]) -> set[int]:
    return set(_bundle_nodes(table))


def _bundle_nodes(table: dict[str, Any]) -> dict[int, str]:
    return {int(i): node for i, node in (table.get("bundles_to_node_id") or {}).items() if node}


def bundle_nodes(group: PlacementGroup, bundles: list[int]) -> set[str | None]:
    """The nodes Ray has placed `bundles` of `group` on (None for one not placed), from one
    read of the placement group's table."""
    placed = _bundle_nodes(placement_group_table(group))
    return {placed.get(b) for b in bundles}


def nodes_alive(nodes: set[str | None]) -> bool:
    """Whether Ray counts every one of `nodes` alive. Ray notices a node's death seconds after
    the fact (missed heartbeats): an actor started in that window, in a bundle still placed on the
    dead node, dies without running, and this tells that apart from a failure of the actor's own."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}  # type: ignore[no-untyped-call]
    return all(node in alive for node in nodes)


@dataclass
class TrainLauncher:
    """Starts the train group in its bundles (again after a failure, with a new rendezvous)."""

    group: PlacementGroup
    bundles: list[int]  # bundle index of rank r
    num_cpus: float
    num_gpus: float
    kwargs: dict[str, Any]  # TrainActor's keyword arguments, except rank and the rendezvous
    node_wait_s: float = 300.0

    def launch(self, tries: int = 3) -> list[TrainHandle]:
        """The ranks, once each has started. The group starts again when a node of its bundles
        died while it started (Ray had not noticed yet), and when the rendezvous port, free when
        picked, was taken before rank 0 bound it (up to `tries` times)."""
        port_tries = 0
        while True:
            wait_for_places(self.group, self.node_wait_s)
            nodes = bundle_nodes(self.group, self.bundles)
            trainers = self._start()
            try:
                ray.get([_ready(t) for t in trainers])
                return trainers
            except RayActorError as exc:
                if not nodes_alive(nodes):
                    log.warning("a node of the train group died as it started; placing it again")
                elif "EADDRINUSE" in str(exc) and port_tries + 1 < tries:
                    port_tries += 1
                    log.warning("the train rendezvous port was taken; starting again on another")
                else:
                    return trainers  # a rank that did not start fails its first call: a lost rank
            for trainer in trainers:
                kill_actor(trainer)

    def _rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port there: picked here when rank 0's bundle is on this
        node, else by a task in that bundle. That task waits for a worker process to start on a
        loaded node as long as it takes; only its node's death ends the wait (then the bundle
        gets fault.node_wait_s to find another place)."""
        if bundle_nodes(self.group, [self.bundles[0]]) == {node_id()}:
            return _address()
        probe = ray.remote(_address).options(num_cpus=0, scheduling_strategy=self._at(0))
        ref = probe.remote()
        while True:
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                address: tuple[str, int] = ray.get(ref)
                return address
            if not nodes_alive(bundle_nodes(self.group, [self.bundles[0]])):
                ray.cancel(ref, force=True)
                wait_for_places(self.group, self.node_wait_s)  # NoPlaceError past the wait
                ref = probe.remote()

    def _start(self) -> list[TrainHandle]:
        master_addr, master_port = self._rendezvous()
        return [
            ray.remote(TrainActor)
            .options(
                num_cpus=self.num_cpus, num_gpus=self.num_gpus, scheduling_strategy=self._at(rank)
            )
            .remote(
                rank=rank,
                world_size=len(self.bundles),
                master_addr=master_addr,
                master_port=master_port,
                **self.kwargs,
            )
            for rank in range(len(self.bundles))
        ]

    def _at(self, rank: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(self.group, self.bundles[rank])


@dataclass
class EngineLauncher:
    """Starts (and restarts) engine actors in their bundles. Picklable, so the engine group can
    restart engines itself."""

    group: PlacementGroup
    bundles: list[int]  # bundle index of engine i
    num_cpus: float
    num_gpus: float
    kwargs: dict[str, Any]  # EngineActor's keyword arguments, except `index`
    node_wait_s: float = 300.0
    started_on: dict[int, set[str | None]] = field(default_factory=dict)  # engine -> its node

    def launch(self, index: int) -> EngineHandle:
        wait_for_places(self.group, self.node_wait_s)
        self.started_on[index] = bundle_nodes(self.group, [self.bundles[index]])
        return (
            engine_actor_class()
            .options(
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                max_concurrency=CONTROL_CONCURRENCY,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.group, self.bundles[index]
                ),
            )
            .remote(index=index, **self.kwargs)
        )

    def node_lost(self, index: int) -> bool:
        """Whether the node engine `index` was last started on has died: a start that failed
        there failed for the node, not for the engine."""
        return index in self.started_on and not nodes_alive(self.started_on[index])


class _RayReady(Protocol):
    def remote(self) -> ObjectRef[bool]: ...


class _Started(Protocol):
    __ray_ready__: _RayReady


def _ready(actor: TrainHandle) -> ObjectRef[bool]:
    """Ray's `__ray_ready__`, which every actor has (it answers once the constructor has run),
    but no actor class declares."""
    return cast(_Started, actor).__ray_ready__.remote()


def cpu_threads_per_actor(actors: int) -> int:
    """On CPU, each actor's share of the cores, so the actors do not oversubscribe the machine
    (torch's thread pools spin at every barrier while a thread of theirs waits for a core).
    OMP_NUM_THREADS, where set, caps it, as torch itself would honour it."""
    share = max(1, (os.cpu_count() or 1) // actors)
    cap = os.environ.get("OMP_NUM_THREADS", "")
    return min(share, int(cap)) if cap.isdigit() and int(cap) > 0 else share


@dataclass
class Placement:
    trainers: list[TrainHandle]
    train_launcher: TrainLauncher
    engines: EngineGroupHandle
    rollout: RolloutHandle
    group: PlacementGroup
    colocated: bool

    @classmethod
    def create(cls, config: RunConfig, run_dir: str) -> Placement:
        gpus = use_gpus(config.cluster.device)
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
        infos = probe_bundles(group, config.cluster.topology_label)
        train_at, engine_at = assign(infos, kinds)  # type: ignore[arg-type]
        if colocated:
            engine_at = train_at[:n_engines]  # engine i shares train rank i's GPU
        share = 0.5 if colocated else 1.0
        layout = describe_layout(infos, train_at, engine_at)
        log.info("placement", mode=config.placement, where=where(layout), layout=layout)

        threads = None if gpus else cpu_threads_per_actor(n_train + n_engines)
        device = "cuda" if gpus else "cpu"
        common = {"config": config, "run_dir": run_dir, "device": device, "num_threads": threads}
        wait = config.fault.node_wait_s
        # Engines and coordinators start first, without waiting: they load their models and
        # data while the train group starts (its launch waits for every rank).
        engine_launcher = EngineLauncher(
            group,
            engine_at,
            num_cpus=share,
            num_gpus=(share if colocated else config.rollout.gpus_per_engine) if gpus else 0,
            kwargs={**common, "record_routing": _record_routing(config)},
            node_wait_s=wait,
        )
        handles = [engine_launcher.launch(i) for i in range(n_engines)]
        # The coordinators live beside the driver (the head node, on a cluster): losing a
        # worker node then costs its train ranks and engines, never the run's bookkeeping.
        # Hard affinity: a soft one lets Ray put them on any node when the driver's offers no
        # CPUs (a head started with --num-cpus=0), even though they ask for none.
        driver_node = node_id()
        add_to_manifest(Path(run_dir), layout=layout, coordinator_node_id=driver_node)
        here = NodeAffinitySchedulingStrategy(driver_node, soft=False)
        engines = (
            ray.remote(EngineGroup)
            .options(num_cpus=0, scheduling_strategy=here)
            .remote(config.fault, run_dir, handles, engine_launcher)
        )
        rollout = (
            ray.remote(RolloutManager)
            .options(num_cpus=0, scheduling_strategy=here)
            .remote(config, run_dir, engines)
        )
        train_launcher = TrainLauncher(
            group, train_at, share, share if gpus else 0, kwargs=common, node_wait_s=wait
        )
        trainers = train_launcher.launch()
        # Surface constructor errors (bad checkpoint, missing file) here, not at the first step.
        ray.get([h.health.remote() for h in handles] + [rollout.flush.remote()])
        ray.get([t.flush.remote() for t in trainers] + [engines.connect.remote(rollout)])
        return cls(trainers, train_launcher, engines, rollout, group, colocated)


def describe_layout(
    infos: list[BundleInfo], train_at: list[int], engine_at: list[int]
) -> list[dict[str, Any]]:
    """Where each train rank and engine runs: bundle, node, IP, topology group, GPUs."""
    by_index = {b.index: b for b in infos}

    def where(role: str, rank: int, bundle: int) -> dict[str, Any]:
        b = by_index[bundle]
        return {
            "role": role,
            "rank": rank,
            "bundle": bundle,
            "node_id": b.node_id,
            "node_ip": b.node_ip,
            "topology": b.topology,
            "gpus": list(b.gpu_ids),
        }

    return [where("train", r, b) for r, b in enumerate(train_at)] + [
        where("engine", i, b) for i, b in enumerate(engine_at)
    ]


def _record_routing(config: RunConfig) -> ReplayMode:
    """What engines record: MoE routing when the model has routers to record and the rollout
    backend can (validation refused a replay it cannot serve)."""
    spec = get_plugin_manager().get(Kind.ROLLOUT_BACKEND, config.rollout.backend).spec
    if not spec.has(Capability.ROUTING_RECORD):
        return "off"
    return record_mode(config.model.path, config.moe.routing_replay)


def _check_capacity(bundles: list[dict[str, int]]) -> None:
    """Fails at once, not after a placement time-out, when the cluster is too small."""
    have = ray.cluster_resources()  # type: ignore[no-untyped-call]
    for resource in ("CPU", "GPU"):
        need = sum(b.get(resource, 0) for b in bundles)
        if need > have.get(resource, 0):
            raise RuntimeError(
                f"this run needs {need} {resource}s (train.world_size + rollout.engines x "
                f"rollout.gpus_per_engine), but the Ray cluster has {have.get(resource, 0):g}; "
                "lower train.world_size or rollout.engines, or add nodes"
            )


def _address() -> tuple[str, int]:
    return node_address(), free_port()


def where(layout: list[dict[str, Any]]) -> str:
    """The layout in a few words: `train 0-1 on 10.0.0.5 GPU 0,1; engine 0 on 10.0.0.6 GPU 0`."""
    groups: dict[tuple[str, str], tuple[list[int], list[str]]] = {}
    for slot in layout:
        ranks, gpus = groups.setdefault((slot["role"], str(slot.get("node_ip", "?"))), ([], []))
        ranks.append(int(slot["rank"]))
        gpus.extend(str(g) for g in slot.get("gpus") or ())
    parts = []
    for (role, node), (ranks, gpus) in groups.items():
        ranks.sort()
        contiguous = ranks == list(range(ranks[0], ranks[-1] + 1))
        span = (
            f"{ranks[0]}-{ranks[-1]}"
            if contiguous and len(ranks) > 1
            else ",".join(map(str, ranks))
        )
        parts.append(f"{role} {span} on {node}" + (f" GPU {','.join(gpus)}" if gpus else ""))
    return "; ".join(parts)
