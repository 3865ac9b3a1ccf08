"""Which bundle of a placement group gets which actor, by node and GPU.

Ray numbers a placement group's bundles in the order they were requested, not by where they
landed: bundle 3 may sit on the first node's GPU 0 and bundle 0 on the second node. Ranks that
talk the most (neighbouring train ranks, an engine's GPUs) should be neighbours on the hardware,
so we ask each bundle where it is and hand out bundles in (topology group, node, GPU) order: the
topology group is the value of a node label (`cluster.topology_label`: a rack, a switch, an
NVLink domain), so train ranks fill one group's nodes before the next, and engines, ordered the
same way, take the places nearest train rank 0 (the one that sends them weights).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.util.placement_group import PlacementGroup

BundleKind = Literal["train", "engine"]


@dataclass(frozen=True)
class BundleInfo:
    index: int  # the bundle's index in the placement group, as requested
    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]  # as `ray.get_gpu_ids()` reports them on that node
    topology: str = ""  # the node's value of the topology label ("": none)

    @property
    def gpus(self) -> int:
        return len(self.gpu_ids)


def probe_bundles(group: PlacementGroup, topology_label: str | None = None) -> list[BundleInfo]:
    """Where each bundle of a ready placement group is: node, IP, topology group, GPU ids.

    Node, IP and labels come from the cluster's tables. GPU ids are known only inside a bundle,
    so each bundle that holds GPUs runs one tiny task that asks for all of them (with
    num_gpus=0, `ray.get_gpu_ids()` is empty): call this before those bundles are filled with
    actors, or the probes wait for them. A bundle without GPUs starts no process.
    """
    import ray
    from ray.util.placement_group import placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    placed = placement_group_table(group).get("bundles_to_node_id") or {}
    nodes = {n["NodeID"]: n for n in ray.nodes()}  # type: ignore[no-untyped-call]
    probe = ray.remote(_where)
    infos: list[BundleInfo | ObjectRef[BundleInfo]] = []
    for index, spec in enumerate(group.bundle_specs):
        node = nodes.get(placed.get(index) or placed.get(str(index)) or "")
        if spec.get("GPU", 0) or node is None:
            strategy = PlacementGroupSchedulingStrategy(group, index)
            options = {"num_cpus": 0, "num_gpus": spec.get("GPU", 0)}
            infos.append(
                probe.options(**options, scheduling_strategy=strategy).remote(index, topology_label)
            )
        else:
            labels = dict(node.get("Labels") or {}) if topology_label else {}
            infos.append(
                BundleInfo(
                    index=index,
                    node_id=node["NodeID"],
                    node_ip=node["NodeManagerAddress"],
                    gpu_ids=(),
                    topology=_label(labels, topology_label),
                )
            )
    refs = [i for i in infos if not isinstance(i, BundleInfo)]
    probed = iter(ray.get(refs, timeout=300))
    return [i if isinstance(i, BundleInfo) else next(probed) for i in infos]


def order_bundles(infos: Sequence[BundleInfo]) -> list[BundleInfo]:
    """Bundles by topology group, then node (IP, numerically: 10.0.0.9 before 10.0.0.10), then
    first GPU id."""
    return sorted(
        infos,
        key=lambda b: (b.topology, _ip_key(b.node_ip), b.node_id, min(b.gpu_ids, default=-1)),
    )


def assign(infos: Sequence[BundleInfo], kinds: Sequence[BundleKind]) -> tuple[list[int], list[int]]:
    """Bundle indexes for train ranks and for engines, each in (node, GPU) order.

    `kinds[i]` is what bundle `i` was requested for (train and engine bundles have different
    shapes, so they cannot be swapped). Train rank r goes to the r-th returned index: ranks fill
    a node before the next, and rank 0 sits on the first node.
    """
    if sorted(b.index for b in infos) != list(range(len(kinds))):
        raise ValueError(
            f"{len(infos)} bundle infos (indexes {sorted(b.index for b in infos)}) do not cover "
            f"the {len(kinds)} bundles of the group"
        )
    train: list[int] = []
    engines: list[int] = []
    for info in order_bundles(infos):
        kind = kinds[info.index]
        if kind == "train":
            train.append(info.index)
        elif kind == "engine":
            engines.append(info.index)
        else:
            raise ValueError(f"bundle {info.index}: unknown kind {kind!r}")
    return train, engines


def _ip_key(ip: str) -> tuple[int, int, str]:
    """IPv4 before IPv6, each numerically; anything that is not an address (a host name) last."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        return (7, 0, ip)
    return (address.version, int(address), "")


def _label(labels: dict[str, Any], topology_label: str | None) -> str:
    value = labels.get(topology_label or "", "")
    return str(value[0] if isinstance(value, list) and value else value or "")


def _where(index: int, topology_label: str | None) -> BundleInfo:
    import ray

    context = ray.get_runtime_context()
    labels: dict[str, Any] = dict(context.get_node_labels() or {}) if topology_label else {}
    return BundleInfo(
        index=index,
        node_id=context.get_node_id(),
        node_ip=ray.util.get_node_ip_address(),  # type: ignore[no-untyped-call]
        gpu_ids=tuple(sorted(int(g) for g in ray.get_gpu_ids())),
        topology=_label(labels, topology_label),
    )
