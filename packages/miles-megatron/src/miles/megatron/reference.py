"""The reference policy of a KL term: this rank's initial weights, kept in host memory (pinned
on CUDA) and copied into the model for the reference forward only, so no second model is held
on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of `t` (pinned when `t` is on CUDA, for fast copies back)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
    return out.copy_(t.detach())


class ReferenceWeights:
    """Host copies of the parameters as they are now, in `parameters()` order."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self._host = [host_copy(p) for p in params]

    @contextmanager
    def swapped_in(self, params: list[torch.Tensor], device: torch.device) -> Iterator[None]:
        """The reference weights in `params` while inside; the policy's afterwards."""
        saved = [host_copy(p) for p in params]
        try:
            with torch.no_grad():
                for p, ref in zip(params, self._host, strict=True):
                    p.copy_(ref, non_blocking=True)
            yield
        finally:
            with torch.no_grad():
                for p, policy in zip(params, saved, strict=True):
                    p.copy_(policy, non_blocking=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
