"""The running batch: one row per live sequence over a shared, left-padded transformers KV cache.

Rows are left-aligned to a common cache length: `mask[b, t]` is 1 where cache slot t of row b
holds a real token and 0 for padding. Positions are tracked per row, so padding never shifts
RoPE. Finished rows are dropped (`compact`) and new ones appended (`merge`), which is what lets
new prompts join while others are still decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from miles.core.types import GenerateRequest
from miles.torch.engine.sampler import SamplingTensors


@dataclass
class Row:
    request: GenerateRequest
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # MoE routing of each token fed through the model so far, in chunks: [tokens, layers, k].
    routing: list[torch.Tensor] = field(default_factory=list)
    routing_weights: list[torch.Tensor] = field(default_factory=list)
    done: bool = False  # finished and reported; still occupies its slot until `compact`


@dataclass
class Batch:
    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, cache_len] int64
    positions: torch.Tensor  # [rows] int64: position id of the next token to feed
    last_tokens: torch.Tensor  # [rows] int64: the next token to feed
    params: SamplingTensors

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_done(self) -> int:
        return sum(row.done for row in self.rows)

    def compact(self) -> None:
        """Drop the finished rows, then the cache columns no remaining row uses."""
        indices = [i for i, row in enumerate(self.rows) if not row.done]
        idx = torch.tensor(indices, dtype=torch.int64, device=self.mask.device)
        self.rows = [self.rows[i] for i in indices]
        self.mask, self.positions = self.mask[idx], self.positions[idx]
        self.last_tokens, self.params = self.last_tokens[idx], self.params.select(idx)
        start = int(self.mask.any(dim=0).int().argmax()) if indices else 0
        self.mask = self.mask[:, start:]
        for layer in _layers(self.cache):
            layer.keys, layer.values = layer.keys[idx, :, start:], layer.values[idx, :, start:]

    def merge(self, other: Batch) -> None:
        """Append `other`'s rows, left-padding the shorter of the two caches to a common length."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, length), _left_pad(theirs.keys, length)])
            mine.values = torch.cat(
                [_left_pad(mine.values, length), _left_pad(theirs.values, length)]
            )
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(other.mask, length)])
        self.rows += other.rows
        self.positions = torch.cat([self.positions, other.positions])
        self.last_tokens = torch.cat([self.last_tokens, other.last_tokens])
        self.params = SamplingTensors.cat([self.params, other.params])


def _layers(cache: DynamicCache) -> list[DynamicLayer]:
    # Sliding-window layers drop old slots, which would break the column bookkeeping above.
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise NotImplementedError("only full-attention KV caches are supported (no sliding window)")
    return cache.layers


def _left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad the sequence dim (dim 2 of a [B, H, T, D] cache, dim 1 of a [B, T] mask)."""
    seq_dim = 1 if x.dim() == 2 else 2
    missing = length - x.shape[seq_dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - seq_dim) + [missing, 0]
    return F.pad(x, pad)
