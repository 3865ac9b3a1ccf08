"""MoE routing records on the paged path: each token's experts, stored beside its K/V.

The forward writes every MoE layer's chosen experts (and gate weights, when asked) at the token's
KV slot, inside the CUDA graph like the K/V themselves. So a prompt page shared by a group, or
found in the prefix cache, carries its tokens' routes to every sequence that uses it; a preempted
sequence rewrites them when it is recomputed; and a finished sequence's record is one gather of
its slots. A token whose K/V are not in the cache (the last sampled one, never fed) records -1.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch


class RouteCache:
    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        top_k: int,
        with_weights: bool,
        index_dtype: np.dtype[Any],
        device: torch.device,
    ) -> None:
        self.index_dtype = index_dtype
        store = torch.int16 if index_dtype.itemsize <= 2 else torch.int32
        self.indices = torch.full((num_slots, num_layers, top_k), -1, dtype=store, device=device)
        self.weights = (
            torch.zeros((num_slots, num_layers, top_k), dtype=torch.float32, device=device)
            if with_weights
            else None
        )

    def write(
        self, layer: int, slots: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
    ) -> None:
        """Layer `layer`'s choice for the tokens at `slots`."""
        self.indices[slots, layer] = indices.to(self.indices.dtype)
        if self.weights is not None:
            self.weights[slots, layer] = weights.float()

    def read(
        self, records: list[tuple[list[int], int]]
    ) -> list[tuple[npt.NDArray[np.integer[Any]], npt.NDArray[np.float32] | None]]:
        """For each (slots of the computed tokens, total tokens): the [total, layers, top_k]
        record, -1 (weights 0) past the computed tokens; one transfer for all of them."""
        if not records:
            return []
        every = [s for slots, _ in records for s in slots]
        where = torch.tensor(every, dtype=torch.int64, device=self.indices.device)
        indices = self.indices[where].cpu().numpy()
        weights = None if self.weights is None else self.weights[where].cpu().numpy()
        out: list[tuple[npt.NDArray[np.integer[Any]], npt.NDArray[np.float32] | None]] = []
        start = 0
        for slots, total in records:
            n = len(slots)
            record = np.full((total, *indices.shape[1:]), -1, dtype=self.index_dtype)
            record[:n] = indices[start : start + n]
            record_weights = None
            if weights is not None:
                record_weights = np.zeros(record.shape, dtype=np.float32)
                record_weights[:n] = weights[start : start + n]
            out.append((record, record_weights))
            start += n
        return out
