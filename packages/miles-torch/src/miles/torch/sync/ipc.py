"""Weight sync between processes that share one GPU: buckets travel as CUDA IPC handles.

When a train rank and a rollout engine are colocated on one GPU, NCCL cannot connect them (it
refuses two ranks on one device), so the trainer packs each bucket of the same `SyncPlan` the
broadcast path uses into one flat tensor and sends a handle to it; the engine maps the trainer's
memory, copies the bucket into its own weights, and the mapping is dropped. No weight bytes cross
PCIe or a socket: the only transfer is a device-to-device copy.

One round trip per bucket, driven by the sender:

    it = iter(named_tensors)
    for bucket in plan.buckets:
        flat = pack_bucket(bucket, it, device)
        ray.get(engine.load_bucket.remote(bucket, share(flat)))  # returns after `consume`
        del flat  # only now: the engine has finished copying out of it
    if next(it, None) is not None: raise RuntimeError(...)

and on the receiver, `consume(bucket, handle, load)` inside `load_bucket`.

The sender must keep `flat` alive until the receiver replies: torch's multiprocessing notes
require the producer to keep a shared CUDA tensor as long as the consumer uses it. (Torch does
count IPC references: a block freed while a reader still holds it waits in a "limbo" list, and a
handle that is never opened keeps its block there for good.) The reply also orders the copy:
`consume` synchronizes the receiver's device before returning, so the sender may then free or
reuse the memory at once.

On CPU (tests, CPU runs) the bucket is copied into a file in shared memory (`/dev/shm`) and the
handle names the file: the engine maps it and copies out, one memcpy on each side instead of
pickling hundreds of MB through Ray's object store. The sender removes the file once the engine
has replied (`release`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from miles.core.contracts.weight_sync import Bucket

# Position of the device index in the arguments `reduce_tensor` returns for a CUDA tensor
# (`rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, storage_device,
# ...)`): unchanged across torch 2.x, and the same constant sglang and checkpoint-engine patch.
_DEVICE_ARG = 6


@dataclass(frozen=True)
class IpcHandle:
    """A picklable reference to one flat bucket in the sender's memory.

    CUDA: `rebuild` and `args` are what `torch.multiprocessing.reductions.reduce_tensor` returns,
    and `device_uuid` names the GPU, because the device index in `args` is the sender's and means
    another GPU in a process with a different CUDA_VISIBLE_DEVICES. CPU: `tensor` is the bucket.
    """

    rebuild: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    device_uuid: str = ""
    # CPU: the shared-memory file holding the bucket, its element count and dtype.
    path: str = ""
    numel: int = 0
    dtype: str = ""


def pack_bucket(
    bucket: Bucket,
    named_tensors: Iterator[tuple[str, torch.Tensor]],
    device: torch.device | str,
) -> torch.Tensor:
    """Takes the bucket's tensors, in plan order, from `named_tensors` and returns them cast to
    the bucket's dtype in one flat contiguous tensor on `device`.

    Each tensor is copied straight into its slice: no per-tensor temporaries, which matters when
    the trainer and an engine share a GPU's memory.
    """
    flat = torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=device)
    offset = 0
    for meta in bucket.tensors:
        item = next(named_tensors, None)
        if item is None:
            raise RuntimeError(
                f"weight sync: expected {meta.name} {meta.shape}, but the trainer has no more "
                "tensors; the model changed after the sync plan was made"
            )
        name, tensor = item
        if name != meta.name or tuple(tensor.shape) != meta.shape:
            raise RuntimeError(
                f"weight sync: expected {meta.name} {meta.shape}, got {name} "
                f"{tuple(tensor.shape)}; the model changed after the sync plan was made"
            )
        flat[offset : offset + meta.numel].view(meta.shape).copy_(tensor.detach())
        offset += meta.numel
    return flat


def unpack_bucket(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) in plan order; the views share `flat`'s memory. Checks the size
    and dtype at once, before any view is taken."""
    if (
        flat.dim() != 1
        or flat.numel() != bucket.numel
        or flat.dtype != getattr(torch, bucket.dtype)
    ):
        raise RuntimeError(
            f"weight sync: a bucket of {bucket.numel} {bucket.dtype} does not match the received "
            f"{tuple(flat.shape)} {str(flat.dtype).removeprefix('torch.')}"
        )
    return _views(bucket, flat)


def _views(bucket: Bucket, flat: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for meta in bucket.tensors:
        yield meta.name, flat[offset : offset + meta.numel].view(meta.shape)
        offset += meta.numel


def share(flat: torch.Tensor) -> IpcHandle:
    """A handle another process on the same host can `open`. Call it on the stream that wrote
    `flat`: torch records an event there, and the receiver waits on it before reading."""
    if flat.device.type != "cuda":
        return _share_cpu(flat)
    rebuild, args = reduce_tensor(flat.detach())
    uuid = str(torch.cuda.get_device_properties(flat.device).uuid)
    return IpcHandle(rebuild=rebuild, args=tuple(args), device_uuid=uuid)


def open(handle: IpcHandle) -> torch.Tensor:
    """Maps the sender's tensor into this process (CUDA) or returns the carried one (CPU).

    The result aliases the sender's memory: copy out of it, then drop it. Open it in another
    process: CUDA IPC does not map a process's own allocation back into it.
    """
    if handle.path:
        dtype = getattr(torch, handle.dtype)
        return torch.from_file(handle.path, shared=False, size=handle.numel, dtype=dtype)
    if handle.rebuild is None:
        raise RuntimeError("weight sync: an empty IPC handle")
    args = list(handle.args)
    # `args[6]` is the sender's `storage.device().index()` (torch's `_share_cuda_`), but
    # `_new_shared_cuda` opens the memory under a device guard for that index in *this*
    # process. Two actors sharing a Ray bundle both see the GPU as cuda:0, so it agrees;
    # under any other CUDA_VISIBLE_DEVICES (an engine over several GPUs, Ray told not to
    # set it) the index names another GPU: an invalid ordinal, or a peer mapping on the
    # wrong device. The UUID is the same in every process, so map it to our own index.
    args[_DEVICE_ARG] = device_of(handle.device_uuid)
    tensor: torch.Tensor = handle.rebuild(*args)
    return tensor


def release(handle: IpcHandle) -> None:
    """The sender's end of a round trip: removes a CPU handle's file (a CUDA handle holds
    nothing beyond the sender's tensor)."""
    if handle.path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(handle.path)


def _share_cpu(flat: torch.Tensor) -> IpcHandle:
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="miles-sync-", suffix=".bin", dir=where)
    nbytes = flat.numel() * flat.element_size()
    try:
        os.ftruncate(fd, nbytes)
        if nbytes:
            shared = torch.from_file(path, shared=True, size=flat.numel(), dtype=flat.dtype)
            shared.copy_(flat)
            del shared
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return IpcHandle(path=path, numel=flat.numel(), dtype=str(flat.dtype).removeprefix("torch."))


def consume(
    bucket: Bucket,
    handle: IpcHandle,
    load: Callable[[Iterator[tuple[str, torch.Tensor]]], None],
) -> None:
    """The receiver's half of one round trip: opens the bucket, hands `load` the named views
    (it must copy them into its own weights), waits for those copies, and drops the mapping.

    Returning is the sender's signal that it may free or reuse the bucket.
    """
    flat = open(handle)
    load(unpack_bucket(bucket, flat))
    if flat.is_cuda:
        # The copies were only queued (on any stream `load` chose); the sender must not reuse
        # the memory under them once we reply.
        torch.cuda.synchronize(flat.device)
    del flat


def device_of(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise RuntimeError(
        f"weight sync: GPU {uuid} holds the trainer's bucket but is not visible here "
        f"(CUDA_VISIBLE_DEVICES sees {torch.cuda.device_count()} GPUs); a colocated engine "
        "must share its train rank's GPU"
    )
