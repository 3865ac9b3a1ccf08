"""Bundle ordering by node and GPU, and the probe that finds out where bundles landed."""

from __future__ import annotations

import random

import pytest

from miles.runtime.cluster.bundles import BundleInfo, assign, order_bundles, probe_bundles

# Two nodes whose IPs sort wrongly as strings ("10.0.0.10" < "10.0.0.9"), 8 GPUs each.
NODE_A = ("node-a", "10.0.0.9")
NODE_B = ("node-b", "10.0.0.10")


def _layout() -> list[BundleInfo]:
    """4 one-GPU train bundles then 3 two-GPU engine bundles (indexes as requested), scattered
    over the nodes the way Ray may place them."""
    placed = [
        (NODE_B, (3,)),  # 0: train
        (NODE_A, (5,)),  # 1: train
        (NODE_B, (0,)),  # 2: train
        (NODE_A, (1,)),  # 3: train
        (NODE_B, (7, 6)),  # 4: engine
        (NODE_A, (2, 0)),  # 5: engine
        (NODE_A, (6, 7)),  # 6: engine
    ]
    return [
        BundleInfo(index=i, node_id=node[0], node_ip=node[1], gpu_ids=gpus)
        for i, (node, gpus) in enumerate(placed)
    ]


KINDS = ["train"] * 4 + ["engine"] * 3


@pytest.mark.parametrize("seed", range(5))
def test_order_is_by_node_ip_then_gpu(seed: int) -> None:
    infos = _layout()
    random.Random(seed).shuffle(infos)
    ordered = order_bundles(infos)
    assert [b.index for b in ordered] == [5, 3, 1, 6, 2, 0, 4]
    assert [b.node_id for b in ordered] == ["node-a"] * 4 + ["node-b"] * 3


@pytest.mark.parametrize("seed", range(5))
def test_assign_packs_each_kind_by_node(seed: int) -> None:
    infos = _layout()
    random.Random(seed).shuffle(infos)
    train, engines = assign(infos, KINDS)
    # Rank 0 on node A's lowest GPU; ranks fill node A before node B.
    assert train == [3, 1, 2, 0]
    assert engines == [5, 6, 4]


def test_order_breaks_ties_by_node_id_and_puts_cpu_bundles_first() -> None:
    infos = [
        BundleInfo(0, "n2", "192.168.1.2", (0,)),
        BundleInfo(1, "n1", "192.168.1.2", (0,)),  # same IP, another node id (e.g. a container)
        BundleInfo(2, "n1", "192.168.1.2", ()),  # a CPU-only bundle
        BundleInfo(3, "n0", "host-name", ()),  # not an IP: last
        BundleInfo(4, "n3", "::1", ()),  # IPv6 after IPv4
    ]
    assert [b.index for b in order_bundles(infos)] == [2, 1, 0, 4, 3]
    assert infos[1].gpus == 1 and infos[2].gpus == 0


def test_topology_groups_come_first_so_ranks_fill_a_rack_before_the_next() -> None:
    infos = [
        BundleInfo(0, "a", "10.0.0.1", (0,), topology="rack2"),
        BundleInfo(1, "b", "10.0.0.2", (0,), topology="rack1"),
        BundleInfo(2, "c", "10.0.0.3", (0,), topology="rack1"),
        BundleInfo(3, "a", "10.0.0.1", (1,), topology="rack2"),
        BundleInfo(4, "d", "10.0.0.4", (0,), topology="rack1"),
    ]
    # Without topology this would be by IP (0, 3, 1, 2, 4): node a holds ranks 0 and 1.
    train, engines = assign(infos, ["train", "train", "train", "engine", "engine"])
    assert train == [1, 2, 0]  # rack1's nodes first, then rack2
    assert engines == [4, 3]  # the engine in rank 0's rack first


def test_assign_rejects_mismatched_inputs() -> None:
    infos = _layout()
    with pytest.raises(ValueError, match="do not cover"):
        assign(infos[:-1], KINDS)
    with pytest.raises(ValueError, match="unknown kind"):
        assign(infos, ["train"] * 4 + ["engine", "rollout", "engine"])  # type: ignore[list-item]


def test_probe_bundles_on_a_local_cluster() -> None:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    # Logical GPUs: Ray hands out ids for them on a CPU machine, so the GPU request path runs too.
    ray.init(
        address="local",  # a Ray of its own, even when another test's cluster runs here
        num_cpus=2,
        num_gpus=2,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        group = placement_group([{"CPU": 1}, {"CPU": 1}, {"GPU": 2}], strategy="PACK")
        ray.get(group.ready(), timeout=60)
        infos = probe_bundles(group)
        node_id = ray.get_runtime_context().get_node_id()
        node_ip = ray.util.get_node_ip_address()
        assert [b.index for b in infos] == [0, 1, 2]
        assert all(b.node_id == node_id and b.node_ip == node_ip for b in infos)
        assert [b.gpu_ids for b in infos] == [(), (), (0, 1)]
        assert assign(infos, ["train", "train", "engine"]) == ([0, 1], [2])
        remove_placement_group(group)
    finally:
        ray.shutdown()


def test_cpu_actors_share_the_cores_and_omp_num_threads_caps_the_share(monkeypatch):
    from miles.runtime.cluster import placement

    monkeypatch.setattr(placement.os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [placement.cpu_threads_per_actor(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert [placement.cpu_threads_per_actor(n) for n in (1, 2, 4)] == [3, 3, 2]
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset in effect, as torch reads it
    assert placement.cpu_threads_per_actor(1) == 8


def test_where_says_the_layout_in_a_few_words() -> None:
    from miles.runtime.cluster.placement import where

    layout = [
        {"role": "train", "rank": 0, "node_ip": "10.0.0.5", "gpus": [0]},
        {"role": "train", "rank": 1, "node_ip": "10.0.0.5", "gpus": [1]},
        {"role": "engine", "rank": 0, "node_ip": "10.0.0.6", "gpus": []},
        {"role": "engine", "rank": 2, "node_ip": "10.0.0.6", "gpus": []},
    ]
    assert where(layout) == "train 0-1 on 10.0.0.5 GPU 0,1; engine 0,2 on 10.0.0.6"
