"""`/update_weights_from_tensor`'s payload: a colocated trainer's bucket, by reference.

SGLang's `serialized_named_tensors` holds, per server, base64 of a pickle of `[(name, tensor)]`
(`load_format: null`) whose CUDA tensors pickle as torch's CUDA IPC rebuild call, with the GPU
named by its UUID (the `rebuild_cuda_tensor` argument that torch fills with a device index:
indices differ between processes, UUIDs do not). Miles never holds the bucket in the engine
actor: the trainer's `IpcHandle` (miles.torch.sync.ipc) arrives there unopened, and each named
tensor is written as a rebuild of a view into the bucket, so the server maps the trainer's memory
itself and no weight byte is copied on the way. On the CPU (`miles serve` only; SGLang needs a
GPU) the handle is a shared-memory file, and the views are rebuilt from it by this module's
`shared_file` and `view`.

The server unpickles with an allowlist: only those rebuild calls, torch's dtypes and classes,
and containers; anything else in a payload is refused with a 400, never called.
"""

from __future__ import annotations

import base64
import io
import math
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing import reductions

from miles.core.contracts.weight_sync import Bucket
from miles.torch.sync.ipc import IpcHandle, device_of

# Positions in the arguments of `rebuild_cuda_tensor` (torch 2.x, as sglang patches them):
# tensor size, stride, storage offset (elements) and the storage's device.
_SIZE, _STRIDE, _OFFSET, _DEVICE = 1, 2, 3, 6


class PayloadRefused(ValueError):
    """A payload that is not what a trainer sends."""


class _Call:
    """Pickles as `func(*args)`: how a tensor is rebuilt on the other side."""

    def __init__(self, func: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.func, self.args


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def serialize_bucket(bucket: Bucket, handle: IpcHandle) -> str:
    """One server's `serialized_named_tensors` entry for a bucket the trainer shared."""
    views: list[tuple[str, _Call]] = []
    offset = 0
    if handle.path:  # CPU: the bucket is a file in shared memory
        flat = _Call(shared_file, (handle.path, handle.numel, handle.dtype))
        for meta in bucket.tensors:
            shape = tuple(meta.shape)
            views.append((meta.name, _Call(view, (flat, shape, _strides(shape), offset))))
            offset += meta.numel
    else:
        if handle.rebuild is None:
            raise ValueError("update_weights_from_tensor: an empty IPC handle")
        base = list(handle.args)
        base[_DEVICE] = handle.device_uuid
        for meta in bucket.tensors:
            shape = tuple(meta.shape)
            args = list(base)
            args[_SIZE] = torch.Size(shape)
            args[_STRIDE] = _strides(shape)
            args[_OFFSET] = int(base[_OFFSET]) + offset
            views.append((meta.name, _Call(handle.rebuild, tuple(args))))
            offset += meta.numel
    return base64.b64encode(pickle.dumps(views, protocol=4)).decode("ascii")


def shared_file(path: str, numel: int, dtype: str) -> torch.Tensor:
    """A CPU bucket in shared memory, mapped (the payload calls this by name)."""
    file = Path(path)
    homes = {Path("/dev/shm"), Path(tempfile.gettempdir())}
    if not file.name.startswith("miles-sync-") or file.parent not in homes:
        raise PayloadRefused(f"update_weights_from_tensor: {path!r} is not a bucket file")
    return torch.from_file(path, shared=False, size=numel, dtype=getattr(torch, dtype))


def view(flat: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Any:
    return torch.as_strided(flat, shape, stride, offset)


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's CUDA IPC rebuild, with the GPU given by UUID (SGLang's convention) or index."""
    args_list = list(args)
    device = args_list[_DEVICE]
    if isinstance(device, str):
        args_list[_DEVICE] = device_of(device)
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*args_list)  # type: ignore[no-untyped-call]
    return tensor


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("miles.sglang.tensors", "shared_file"): shared_file,
    ("miles.sglang.tensors", "view"): view,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch", "TypedStorage"): torch.TypedStorage,
    ("torch.storage", "TypedStorage"): torch.TypedStorage,
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise PayloadRefused(
            f"update_weights_from_tensor: the payload calls {module}.{name}, which is not a "
            "tensor rebuild; refused"
        )


def load_named_tensors(entry: str) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of one `serialized_named_tensors` entry; tensors alias the
    trainer's memory, so copy out of them before replying."""
    try:
        raw = base64.b64decode(entry, validate=True)
    except ValueError as exc:
        raise PayloadRefused(f"serialized_named_tensors: not base64: {exc}") from None
    try:
        named = _Unpickler(io.BytesIO(raw)).load()
    except PayloadRefused:
        raise
    except Exception as exc:
        raise PayloadRefused(
            f"serialized_named_tensors: not a tensor payload: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(named, list) or not all(
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], torch.Tensor)
        for item in named
    ):
        raise PayloadRefused("serialized_named_tensors: expected a list of (name, tensor)")
    return named
