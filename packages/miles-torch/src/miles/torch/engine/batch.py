"""The running batch: one row per live sequence over a shared transformers cache.

Two layouts, chosen per model by `batching_mode`:

- padded: rows are left-aligned to a common cache length; `mask[b, t]` is 1 where cache slot t of
  row b holds a real token and 0 for padding. Positions are tracked per row, so padding never
  shifts RoPE. Finished rows are dropped (`compact`) and new ones appended (`merge`), which is
  what lets new prompts join while others are still decoding. Per-row states without a sequence
  dimension (linear-attention conv and recurrent states) are selected and concatenated by row.
- unpadded: for caches whose contents depend on absolute token slots (sliding windows,
  compressed-window attention), where padding would change the result. Every row of a batch
  holds the same number of tokens, so no slot is padding; rows are dropped through the cache's
  own `reorder_cache`, and such batches are never merged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import (
    DynamicIndexedLayer,
    DynamicLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from miles.core.contracts.types import GenerateRequest
from miles.torch.engine.logits import LogitsProcessor, TopLogprobs
from miles.torch.engine.sampler import SamplingTensors

# Cache layers whose padded slots stay inert: attention masks them, and linear-attention models
# zero padded inputs before their convolution and recurrence (transformers' recurrent mask).
_PADDABLE = (
    DynamicLayer,
    DynamicIndexedLayer,
    LinearAttentionLayer,
    LinearAttentionAndFullAttentionLayer,
)


@dataclass
class Row:
    request: GenerateRequest
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # MoE routing of each token fed through the model so far, in chunks: [tokens, layers, k].
    routing: list[torch.Tensor] = field(default_factory=list)
    routing_weights: list[torch.Tensor] = field(default_factory=list)
    done: bool = False  # finished and reported; still occupies its slot until `compact`
    # What the request asked for beyond logprobs (see `logits`).
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)


def batching_mode(cache: DynamicCache) -> tuple[str, str]:
    """("padded" or "unpadded", why) for a fresh cache made from the model's config."""
    kinds = sorted({type(layer).__name__ for layer in cache.layers})
    odd = [
        (i, type(layer).__name__)
        for i, layer in enumerate(cache.layers)
        if type(layer) not in _PADDABLE
    ]
    if odd:
        i, name = odd[0]
        return "unpadded", (
            f"cache layer {i} is a {name}; only full-attention, DSA-indexed and linear-attention "
            "layers can be left-padded (sliding-window and compressed caches tie state to "
            "absolute token slots): rows of equal length share a forward"
        )
    if any(isinstance(layer, LinearAttentionLayer) for layer in cache.layers):
        return "padded", (
            f"cache layers {', '.join(kinds)}: left-padded continuous batching; "
            "linear-attention states are compacted and merged by row"
        )
    return "padded", f"cache layers {', '.join(kinds)}: left-padded continuous batching"


@dataclass
class Batch:
    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, cache_len] int64
    positions: torch.Tensor  # [rows] int64: position id of the next token to feed
    last_tokens: torch.Tensor  # [rows] int64: the next token to feed
    params: SamplingTensors
    padded: bool = True  # False: every row has the same length and the mask is all ones
    # Penalties and constraints of the rows (state kept while the rows stay the same).
    processor: LogitsProcessor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_done(self) -> int:
        return sum(row.done for row in self.rows)

    def compact(self) -> None:
        """Drop the finished rows, then (padded) the cache columns no remaining row uses.

        Unpadded batches drop rows only once all are done: their caches keep state (compression
        buffers) that not every transformers version's `reorder_cache` selects, so finished rows
        ride along, their tokens ignored, until the batch ends.
        """
        indices = [i for i, row in enumerate(self.rows) if not row.done]
        if not self.padded and indices:
            return
        idx = torch.tensor(indices, dtype=torch.int64, device=self.mask.device)
        self.rows = [self.rows[i] for i in indices]
        self.mask, self.positions = self.mask[idx], self.positions[idx]
        self.last_tokens, self.params = self.last_tokens[idx], self.params.select(idx)
        if not indices:
            return
        # Rows of every state each layer keeps, by transformers' own (beam-search) reorder.
        self.cache.reorder_cache(cast(torch.LongTensor, idx))
        start = int(self.mask.any(dim=0).int().argmax())
        self.mask = self.mask[:, start:]
        if start:
            for layer in self.cache.layers:
                _drop_columns(layer, start)

    def merge(self, other: Batch) -> None:
        """Append `other`'s rows, left-padding the shorter of the two caches to a common length."""
        if not (self.padded and other.padded):
            raise ValueError("only padded batches can be merged")
        length = max(self.mask.shape[1], other.mask.shape[1])
        # Cache layer classes differ between transformers versions: typed loosely here.
        layers: list[tuple[Any, Any]] = list(
            zip(self.cache.layers, other.cache.layers, strict=True)
        )
        for mine, theirs in layers:
            keys, values = getattr(mine, "keys", None), getattr(mine, "values", None)
            if isinstance(mine, DynamicLayer) and keys is not None and values is not None:
                mine.keys = torch.cat([_left_pad(keys, length), _left_pad(theirs.keys, length)])
                mine.values = torch.cat(
                    [_left_pad(values, length), _left_pad(theirs.values, length)]
                )
            if isinstance(mine, DynamicIndexedLayer):
                _merge_indexer(mine, theirs, length)
            if isinstance(mine, LinearAttentionLayer):
                _cat_states(mine.conv_states, theirs.conv_states)
                _cat_states(mine.recurrent_states, theirs.recurrent_states)
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(other.mask, length)])
        self.rows += other.rows
        self.positions = torch.cat([self.positions, other.positions])
        self.last_tokens = torch.cat([self.last_tokens, other.last_tokens])
        self.params = SamplingTensors.cat([self.params, other.params])


def _drop_columns(layer: object, start: int) -> None:
    """Drop the first `start` sequence slots of a layer: K/V are [B, H, T, D], DSA indexer keys
    [B, T, D] (and their positions, where a version keeps them, [P, B, T])."""
    keys = getattr(layer, "keys", None)
    if isinstance(keys, torch.Tensor) and keys.dim() == 4:
        layer.keys, layer.values = keys[:, :, start:], layer.values[:, :, start:]  # type: ignore[attr-defined]
    indexer_keys = getattr(layer, "indexer_keys", None)
    if isinstance(indexer_keys, torch.Tensor) and indexer_keys.numel():
        layer.indexer_keys = indexer_keys[:, start:]  # type: ignore[attr-defined]
    positions = getattr(layer, "indexer_position_ids", None)
    if isinstance(positions, torch.Tensor):
        layer.indexer_position_ids = positions[:, :, start:]  # type: ignore[attr-defined]


def _cat_states(mine: Any, theirs: Any) -> None:
    """Concatenate per-row linear-attention states by row (a dict or, in older transformers, a
    list per layer; no sequence dimension)."""
    keys = list(mine) if isinstance(mine, dict) else range(len(mine))
    for key in keys:
        if mine[key] is not None and theirs[key] is not None:
            mine[key] = torch.cat([mine[key], theirs[key]])


def _merge_indexer(mine: Any, theirs: Any, length: int) -> None:
    if mine.is_indexer_initialized and mine.indexer_keys.numel():
        mine.indexer_keys = torch.cat(
            [_left_pad(mine.indexer_keys, length, 1), _left_pad(theirs.indexer_keys, length, 1)]
        )
    positions = getattr(mine, "indexer_position_ids", None)
    if positions is not None:
        mine.indexer_position_ids = torch.cat(
            [
                _left_pad(positions, length, 2),
                _left_pad(theirs.indexer_position_ids, length, 2),
            ],
            dim=1,
        )


def _left_pad(x: torch.Tensor, length: int, seq_dim: int | None = None) -> torch.Tensor:
    """Zero-pad the sequence dim (dim 2 of a [B, H, T, D] cache, dim 1 of a [B, T] mask)."""
    if seq_dim is None:
        seq_dim = 1 if x.dim() == 2 else 2
    missing = length - x.shape[seq_dim]
    if missing == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - seq_dim) + [missing, 0]
    return F.pad(x, pad)
