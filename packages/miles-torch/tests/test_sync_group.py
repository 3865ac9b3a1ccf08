"""Bucketed weight sync over a process group of its own, verified by checksum."""

from __future__ import annotations

import multiprocessing as mp
import socket

import torch

from miles.core.contracts.weight_sync import plan_buckets
from miles.torch.sync.checksum import tensors_checksum
from miles.torch.sync.group import SyncGroup, meta_of


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(64, 32, generator=g)),
        ("a.bias", torch.randn(32, generator=g)),
        ("b.weight", torch.randn(128, 64, generator=g).to(torch.bfloat16)),
        ("c.weight", torch.randn(16, generator=g)),
    ]


def test_plan_buckets_respects_budget_dtype_and_order() -> None:
    plan = plan_buckets((meta_of(n, t) for n, t in _weights()), bucket_bytes=4096)
    names = [[m.name for m in b.tensors] for b in plan.buckets]
    # a.weight alone exceeds the budget; dtype changes split buckets; order is kept.
    assert names == [["a.weight"], ["a.bias"], ["b.weight"], ["c.weight"]]
    big = plan_buckets((meta_of(n, t) for n, t in _weights()), bucket_bytes=1 << 20)
    assert [[m.name for m in b.tensors] for b in big.buckets] == [
        ["a.weight", "a.bias"],
        ["b.weight"],
        ["c.weight"],
    ]
    assert (
        plan.num_bytes == big.num_bytes == sum(t.numel() * t.element_size() for _, t in _weights())
    )


def _receiver(port: int, plan: object, out: mp.Queue) -> None:
    group = SyncGroup("127.0.0.1", port, 2, 1)
    received = [(n, t.clone()) for n, t in group.receive(plan)]  # type: ignore[arg-type]
    out.put(tensors_checksum(received))


def test_broadcast_delivers_identical_weights() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    plan = plan_buckets((meta_of(n, t) for n, t in _weights()), bucket_bytes=8192)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, plan, out))
    proc.start()
    sender = SyncGroup("127.0.0.1", port, 2, 0)
    sent = sender.send(plan, _weights())
    remote = out.get(timeout=60)
    proc.join(timeout=60)
    assert sent == plan.num_bytes
    assert remote == tensors_checksum(_weights())
    changed = [(n, t + 1e-3 if n == "c.weight" else t) for n, t in _weights()]
    assert remote != tensors_checksum(changed)  # the checksum does catch a changed tensor


def test_checksum_ignores_order_and_device_but_not_dtype() -> None:
    w = _weights()
    assert tensors_checksum(w) == tensors_checksum(list(reversed(w)))
    assert tensors_checksum(w) != tensors_checksum([(n, t.double()) for n, t in w])
