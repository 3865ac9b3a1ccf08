"""Weight-sync buckets through IPC handles: packing, unpacking, and a second process reading them.

The two-process test runs on CPU too (the handle then carries the tensor through a queue), so the
harness is exercised everywhere; on a GPU the handle carries only a CUDA IPC reference.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import runpy
from typing import Any

import pytest
import torch

from miles.core.contracts.weight_sync import SyncPlan, TensorMeta, plan_buckets
from miles.torch.sync import ipc
from miles.torch.sync.checksum import tensors_checksum
from miles.torch.sync.group import meta_of

torch.set_num_threads(1)


def _weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(64, 32, generator=g)),
        ("layer.q.weight", torch.randn(32, 32, generator=g)),
        ("layer.q.bias", torch.randn(32, generator=g)),
        ("layer.norm.weight", torch.randn(32, generator=g).to(torch.bfloat16)),
        ("layer.mlp.weight", torch.randn(48, 32, generator=g).to(torch.bfloat16)),
        ("scale", torch.tensor(0.5)),
    ]


def _plan(rollout_dtype: dict[str, str] | None = None) -> SyncPlan:
    """Buckets of several tensors, fp32 and bf16; `rollout_dtype` overrides a tensor's dtype the
    way an engine in another precision would."""
    metas = []
    for name, tensor in _weights():
        meta = meta_of(name, tensor)
        dtype = (rollout_dtype or {}).get(name, meta.dtype)
        metas.append(TensorMeta(meta.name, meta.shape, dtype))
    return plan_buckets(metas, bucket_bytes=10_000)


def _expected(plan: SyncPlan) -> list[tuple[str, torch.Tensor]]:
    dtypes = {m.name: getattr(torch, m.dtype) for b in plan.buckets for m in b.tensors}
    return [(n, t.to(dtypes[n])) for n, t in _weights()]


def _send_all(plan: SyncPlan, device: str) -> list[tuple[str, torch.Tensor]]:
    """Packs every bucket, unpacks it again, and copies the views out (one process)."""
    it = iter(_weights())
    out = []
    for bucket in plan.buckets:
        flat = ipc.pack_bucket(bucket, it, device)
        assert flat.is_contiguous() and flat.dim() == 1 and flat.numel() == bucket.numel
        assert flat.dtype == getattr(torch, bucket.dtype) and flat.device.type == device
        out += [(n, t.clone()) for n, t in ipc.unpack_bucket(bucket, flat)]
    assert next(it, None) is None
    return out


def test_plan_has_multi_tensor_buckets_of_both_dtypes() -> None:
    plan = _plan()
    assert [(b.dtype, len(b.tensors)) for b in plan.buckets] == [
        ("float32", 1),  # embed.weight fills a bucket by itself
        ("float32", 2),
        ("bfloat16", 2),
        ("float32", 1),
    ]


def test_pack_unpack_round_trip_is_exact() -> None:
    plan = _plan()
    received = _send_all(plan, "cpu")
    assert [n for n, _ in received] == [n for n, _ in _weights()]
    assert tensors_checksum(received) == tensors_checksum(_weights())
    for (_, got), (_, want) in zip(received, _weights(), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_pack_casts_to_the_bucket_dtype() -> None:
    # fp32 trainer weights, bf16 engine: everything travels as the engine's dtype.
    plan = _plan(rollout_dtype={n: "bfloat16" for n, _ in _weights()})
    assert {b.dtype for b in plan.buckets} == {"bfloat16"}
    received = _send_all(plan, "cpu")
    assert tensors_checksum(received) == tensors_checksum(_expected(plan))
    assert tensors_checksum(received) != tensors_checksum(_weights())


def test_unpack_views_share_the_flat_buffer() -> None:
    bucket = _plan().buckets[1]
    flat = ipc.pack_bucket(bucket, iter(_weights()[1:3]), "cpu")
    (_, first), (_, second) = ipc.unpack_bucket(bucket, flat)
    flat.zero_()
    assert not first.any() and not second.any()


def test_pack_rejects_a_model_that_differs_from_the_plan() -> None:
    bucket = _plan().buckets[1]  # layer.q.weight, layer.q.bias
    w = dict(_weights())
    with pytest.raises(RuntimeError, match=r"expected layer.q.weight \(32, 32\), got embed.weight"):
        ipc.pack_bucket(bucket, iter([("embed.weight", w["embed.weight"])]), "cpu")
    with pytest.raises(
        RuntimeError, match=r"expected layer.q.bias \(32,\), got layer.q.bias \(33,\)"
    ):
        ipc.pack_bucket(
            bucket,
            iter([("layer.q.weight", w["layer.q.weight"]), ("layer.q.bias", torch.ones(33))]),
            "cpu",
        )
    with pytest.raises(RuntimeError, match="no more tensors"):
        ipc.pack_bucket(bucket, iter([("layer.q.weight", w["layer.q.weight"])]), "cpu")


def test_unpack_rejects_a_buffer_of_another_size_or_dtype() -> None:
    bucket = _plan().buckets[1]
    with pytest.raises(RuntimeError, match="does not match"):
        ipc.unpack_bucket(bucket, torch.zeros(bucket.numel + 1))
    with pytest.raises(RuntimeError, match="does not match"):
        ipc.unpack_bucket(bucket, torch.zeros(bucket.numel, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_handle_names_a_shared_file_and_pickles(dtype: torch.dtype) -> None:
    flat = torch.arange(10, dtype=dtype)
    handle = ipc.share(flat)
    assert handle.rebuild is None and os.path.isfile(handle.path)
    flat.zero_()  # the file holds a copy: the sender may reuse its buffer
    assert torch.equal(ipc.open(pickle.loads(pickle.dumps(handle))), torch.arange(10, dtype=dtype))
    ipc.release(handle)
    assert not os.path.exists(handle.path)
    ipc.release(handle)  # twice is harmless
    with pytest.raises(RuntimeError, match="empty"):
        ipc.open(ipc.IpcHandle())


def test_consume_hands_views_to_load() -> None:
    plan = _plan()
    bucket = plan.buckets[2]  # the two bf16 tensors
    flat = ipc.pack_bucket(bucket, iter(_weights()[3:5]), "cpu")
    got: list[tuple[str, torch.Tensor]] = []
    handle = ipc.share(flat)
    ipc.consume(bucket, handle, lambda named: got.extend((n, t.clone()) for n, t in named))
    ipc.release(handle)
    assert tensors_checksum(got) == tensors_checksum(_weights()[3:5])


# --- a second process -------------------------------------------------------------------------


def _engine(plan: SyncPlan, device: str, inbox: Any, outbox: Any) -> None:
    """A stand-in rollout engine: weights of its own, loaded bucket by bucket from handles."""
    torch.set_num_threads(1)
    params = {
        m.name: torch.full(m.shape, -1.0, dtype=getattr(torch, m.dtype), device=device)
        for b in plan.buckets
        for m in b.tensors
    }
    seen: list[tuple[str, float]] = []  # device and sum of each bucket's first tensor

    def load(named: Any) -> None:
        first = True
        for name, view in named:
            params[name].copy_(view)
            if first:
                seen.append((str(view.device), float(view.double().sum())))
                # After the copy, write into the view: on CUDA the sender sees this, which
                # proves the handle mapped its memory rather than carrying a copy.
                view.view(-1)[0] = SENTINEL
                first = False

    for index, bucket in enumerate(plan.buckets):
        handle = inbox.get(timeout=120)
        ipc.consume(bucket, handle, load)
        outbox.put(("loaded", index, *seen[-1]))
    outbox.put(("checksum", tensors_checksum(params.items())))
    # The sender now scribbles over its buckets; our copies must not change.
    assert inbox.get(timeout=120) == "scribbled"
    outbox.put(("checksum", tensors_checksum(params.items())))


SENTINEL = 96.0  # exact in bf16 and fp32
ENGINE_RUN_NAME = "__ipc_engine__"


def _sync_to_a_second_process(device: str, plan: SyncPlan) -> None:
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    # pytest's importlib mode names this module after its path ("packages.miles-core..."), which
    # a spawned child cannot import, so the child runs this file itself and then `_engine`.
    engine_args = {"ENGINE_ARGS": (plan, device, inbox, outbox)}
    proc = ctx.Process(
        target=runpy.run_path, args=(__file__, engine_args, ENGINE_RUN_NAME), daemon=True
    )
    proc.start()
    try:
        it = iter(_weights())
        kept = []  # every bucket stays alive, to be scribbled over at the end
        for index, bucket in enumerate(plan.buckets):
            flat = ipc.pack_bucket(bucket, it, device)
            first = float(flat[: bucket.tensors[0].numel].double().sum())
            handle = ipc.share(flat)
            assert bool(handle.path) == (device == "cpu")
            inbox.put(handle)
            # The round trip: the sender frees nothing until the engine has loaded the bucket.
            tag, loaded, where, seen = outbox.get(timeout=120)
            assert (tag, loaded) == ("loaded", index)
            ipc.release(handle)
            assert where.startswith(device) and seen == pytest.approx(first, rel=1e-6)
            if device == "cuda":
                assert flat[0].item() == SENTINEL  # the engine wrote into our memory
            kept.append(flat)
        assert next(it, None) is None
        tag, remote = outbox.get(timeout=120)
        assert tag == "checksum"
        assert remote == tensors_checksum(_expected(plan))
        for flat in kept:
            flat.fill_(7.0)
        if device == "cuda":
            torch.cuda.synchronize()
        inbox.put("scribbled")
        assert outbox.get(timeout=120) == ("checksum", remote)
        proc.join(timeout=60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()


def test_second_process_loads_every_bucket_on_cpu() -> None:
    _sync_to_a_second_process("cpu", _plan())


@pytest.mark.gpu
def test_second_process_loads_every_bucket_over_cuda_ipc() -> None:
    _sync_to_a_second_process("cuda", _plan())


@pytest.mark.gpu
def test_cuda_ipc_casts_fp32_weights_into_bf16_buckets() -> None:
    # The colocated case: fp32 trainer weights, a bf16 engine; mixed dtypes over both buckets.
    plan = _plan(rollout_dtype={"embed.weight": "bfloat16", "layer.q.bias": "bfloat16"})
    assert len({b.dtype for b in plan.buckets}) == 2
    _sync_to_a_second_process("cuda", plan)


@pytest.mark.gpu
def test_cuda_handle_names_the_gpu_by_uuid() -> None:
    flat = torch.arange(8, dtype=torch.float32, device="cuda")
    handle = ipc.share(flat)
    assert not handle.path and handle.rebuild is not None
    assert handle.args[6] == flat.device.index  # the sender's index, which `open` replaces
    assert handle.device_uuid == str(torch.cuda.get_device_properties(flat.device).uuid)
    assert ipc.device_of(handle.device_uuid) == flat.device.index
    with pytest.raises(RuntimeError, match="not visible here"):
        ipc.device_of("GPU-00000000-0000-0000-0000-000000000000")
    pickle.loads(pickle.dumps(handle))  # travels through Ray and queues


if __name__ == ENGINE_RUN_NAME:
    _engine(*ENGINE_ARGS)  # type: ignore[name-defined]  # noqa: F821 - given by runpy
