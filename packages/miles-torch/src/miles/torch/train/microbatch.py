"""Splitting a packed batch into right-padded micro-batches, and sharing them out over ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from miles.core.types import PackedBatch, split_by_token_budget


@dataclass
class MicroBatch:
    """Some sequences of a batch as a right-padded [rows, cols] block, plus index maps.

    The micro-batch's flat tokens are its sequences concatenated (as in `PackedBatch`); token j
    of the flat layout is `batch.tokens[token_index[j]]`. Flat token `target_pos[k]` is predicted
    by the logits at `[rows[k], cols[k]]`; each sequence's first token has no prediction.
    """

    input_ids: torch.Tensor  # [B, L] int64, right-padded with token 0
    attention_mask: torch.Tensor  # [B, L] int64
    token_index: npt.NDArray[np.int64]  # [N] flat token -> batch token
    seq_index: torch.Tensor  # [N] int64: which row each flat token belongs to
    rows: torch.Tensor  # [N - B] int64
    cols: torch.Tensor  # [N - B] int64
    target_pos: torch.Tensor  # [N - B] int64
    # Padding micro-batches exist only so every rank runs as many passes as the others (FSDP's
    # collectives must match): their results are discarded and their loss weights are zero.
    is_padding: bool = False
    # MoE routing records laid out like input_ids, flattened: [B * L, moe_layers, top_k] expert
    # indices (-1 at padding and where nothing was recorded) and gate weights; None without.
    routing: torch.Tensor | None = None
    routing_weights: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_index)


def make_micro_batch(
    batch: PackedBatch, seqs: list[int], device: torch.device, is_padding: bool = False
) -> MicroBatch:
    starts = batch.offsets[seqs]
    lens = batch.seq_lens[seqs]
    width = int(lens.max())
    input_ids = np.zeros((len(seqs), width), dtype=np.int64)
    attention_mask = np.zeros((len(seqs), width), dtype=np.int64)
    token_index, seq_index, rows, cols, target_pos = [], [], [], [], []
    flat = 0
    for row, (start, n) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
        input_ids[row, :n] = batch.tokens[start : start + n]
        attention_mask[row, :n] = 1
        token_index.append(np.arange(start, start + n))
        seq_index.append(np.full(n, row))
        # Token t (t >= 1) of the sequence is predicted by the logits at position t - 1.
        rows.append(np.full(n - 1, row))
        cols.append(np.arange(n - 1))
        target_pos.append(np.arange(flat + 1, flat + n))
        flat += n

    def tensor(parts: list[npt.NDArray[np.int64]]) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(device)

    def block(records: npt.NDArray[Any] | None, fill: float) -> torch.Tensor | None:
        """Per-token records (aligned with batch.tokens) in the [B, L] layout, flattened the way
        the model flattens tokens for its routers."""
        if records is None:
            return None
        out = np.full((len(seqs), width, *records.shape[1:]), fill, dtype=records.dtype)
        for row, (start, n) in enumerate(zip(starts.tolist(), lens.tolist(), strict=True)):
            out[row, :n] = records[start : start + n]
        return torch.from_numpy(out.reshape(len(seqs) * width, *records.shape[1:])).to(device)

    return MicroBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        attention_mask=torch.from_numpy(attention_mask).to(device),
        token_index=np.concatenate(token_index).astype(np.int64),
        seq_index=tensor(seq_index),
        rows=tensor(rows),
        cols=tensor(cols),
        target_pos=tensor(target_pos),
        is_padding=is_padding,
        routing=block(batch.routing, -1),
        routing_weights=block(batch.routing_weights, 0.0),
    )


def plan_micro_batches(seq_lens: npt.NDArray[np.int64], budget: int) -> list[list[int]]:
    """Sequence indices of each micro-batch of at most `budget` tokens (a longer sequence gets
    one of its own). Longest first, so that sequences of similar length share a micro-batch and
    right-padding wastes little."""
    order = np.argsort(-np.asarray(seq_lens), kind="stable")
    groups = split_by_token_budget(np.asarray(seq_lens)[order], budget)
    return [[int(order[i]) for i in group] for group in groups]


def shard_micro_batches(
    batch: PackedBatch, budget: int, rank: int, world_size: int, device: torch.device
) -> list[MicroBatch]:
    """This rank's micro-batches: r, r + W, r + 2W, ... of the whole batch's plan.

    Every rank gets the same number: short ranks are topped up with padding micro-batches (the
    batch's first sequence, results discarded).
    """
    if len(batch) == 0:
        raise ValueError("empty batch")
    groups = plan_micro_batches(batch.seq_lens, budget)
    per_rank = -(-len(groups) // world_size)
    mine = groups[rank::world_size]
    out = [make_micro_batch(batch, seqs, device) for seqs in mine]
    out += [make_micro_batch(batch, [0], device, is_padding=True)] * (per_rank - len(mine))
    return out
