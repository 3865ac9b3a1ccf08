"""Splitting a packed batch into micro-batches, and sharing them out over ranks.

A micro-batch is either one row of its sequences concatenated (packed: per-sequence position ids
and cumulative lengths for variable-length attention, no padding), or a right-padded
[rows, cols] block with an attention mask, for models whose family cannot pack.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import PackedBatch, split_by_token_budget


@dataclass
class MicroBatch:
    """Some sequences of a batch as model inputs, plus index maps.

    The micro-batch's flat tokens are its sequences concatenated (as in `PackedBatch`); token j
    of the flat layout is `batch.tokens[token_index[j]]`. Flat token `target_pos[k]` is predicted
    by the logits at `[rows[k], cols[k]]`; each sequence's first token has no prediction.
    Packed, the inputs are that flat layout as one row ([1, N]); padded, a [B, L] block.
    """

    input_ids: torch.Tensor  # [1, N] packed; [B, L] int64 right-padded with token 0
    attention_mask: torch.Tensor | None  # [B, L] int64 padded; None packed
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
    # Packed only: each token's position in its sequence [1, N], and the sequences' cumulative
    # lengths [B + 1] int32 with the longest length (what variable-length attention takes).
    position_ids: torch.Tensor | None = None
    cu_seq_lens: torch.Tensor | None = None
    max_seq_len: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_index)

    @property
    def packed(self) -> bool:
        return self.cu_seq_lens is not None

    def model_inputs(self) -> dict[str, Any]:
        """Keyword arguments of the model's forward for this micro-batch (cache off)."""
        if self.cu_seq_lens is None:
            return {"input_ids": self.input_ids, "attention_mask": self.attention_mask}
        return {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            # The keywords transformers passes through to the attention function.
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_seq_len,
            "max_length_k": self.max_seq_len,
        }


def make_micro_batch(
    batch: PackedBatch,
    seqs: list[int],
    device: torch.device,
    is_padding: bool = False,
    packed: bool = False,
) -> MicroBatch:
    starts = batch.offsets[seqs].tolist()
    lens = batch.seq_lens[seqs].tolist()
    token_index = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    seq_index = np.repeat(np.arange(len(seqs)), lens)
    first = np.cumsum([0, *lens[:-1]])  # flat index of each sequence's first token
    # Token t (t >= 1) of a sequence is predicted at its position t - 1.
    target_pos = np.setdiff1d(np.arange(len(token_index)), first, assume_unique=True)

    def tensor(values: npt.NDArray[Any], dtype: torch.dtype | None = torch.int64) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values)).to(device=device, dtype=dtype)

    common: dict[str, Any] = {
        "token_index": token_index.astype(np.int64),
        "seq_index": tensor(seq_index),
        "target_pos": tensor(target_pos),
        "is_padding": is_padding,
    }
    if packed:
        position = np.arange(len(token_index)) - np.repeat(first, lens)

        def flat(records: npt.NDArray[Any] | None) -> torch.Tensor | None:
            return None if records is None else tensor(records[token_index], dtype=None)

        return MicroBatch(
            input_ids=tensor(batch.tokens[token_index])[None],
            attention_mask=None,
            rows=torch.zeros(len(target_pos), dtype=torch.int64, device=device),
            cols=tensor(target_pos - 1),
            routing=flat(batch.routing),
            routing_weights=flat(batch.routing_weights),
            position_ids=tensor(position)[None],
            cu_seq_lens=tensor(np.cumsum([0, *lens]), dtype=torch.int32),
            max_seq_len=int(max(lens)),
            **common,
        )

    width = int(max(lens))
    input_ids = np.zeros((len(seqs), width), dtype=np.int64)
    attention_mask = np.zeros((len(seqs), width), dtype=np.int64)
    rows, cols = [], []
    for row, (start, n) in enumerate(zip(starts, lens, strict=True)):
        input_ids[row, :n] = batch.tokens[start : start + n]
        attention_mask[row, :n] = 1
        rows.append(np.full(n - 1, row))
        cols.append(np.arange(n - 1))

    def block(records: npt.NDArray[Any] | None, fill: float) -> torch.Tensor | None:
        """Per-token records (aligned with batch.tokens) in the [B, L] layout, flattened the way
        the model flattens tokens for its routers."""
        if records is None:
            return None
        out = np.full((len(seqs), width, *records.shape[1:]), fill, dtype=records.dtype)
        for row, (start, n) in enumerate(zip(starts, lens, strict=True)):
            out[row, :n] = records[start : start + n]
        return tensor(out.reshape(len(seqs) * width, *records.shape[1:]), dtype=None)

    return MicroBatch(
        input_ids=tensor(input_ids),
        attention_mask=tensor(attention_mask),
        rows=tensor(np.concatenate(rows)),
        cols=tensor(np.concatenate(cols)),
        routing=block(batch.routing, -1),
        routing_weights=block(batch.routing_weights, 0.0),
        **common,
    )


def plan_micro_batches(seq_lens: npt.NDArray[np.int64], budget: int) -> list[list[int]]:
    """Sequence indices of each micro-batch of at most `budget` tokens (a longer sequence gets
    one of its own). Longest first, so that sequences of similar length share a micro-batch and,
    where micro-batches are padded, padding wastes little."""
    order = np.argsort(-np.asarray(seq_lens), kind="stable")
    groups = split_by_token_budget(np.asarray(seq_lens)[order], budget)
    return [[int(order[i]) for i in group] for group in groups]


def shard_micro_batches(
    batch: PackedBatch,
    budget: int,
    rank: int,
    world_size: int,
    device: torch.device,
    packed: bool = False,
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
    out = [make_micro_batch(batch, seqs, device, packed=packed) for seqs in mine]
    filler = make_micro_batch(batch, [0], device, is_padding=True, packed=packed)
    out += [filler] * (per_rank - len(mine))
    return out


def per_token(
    array: npt.NDArray[np.floating[Any]], mb: MicroBatch, device: torch.device
) -> torch.Tensor:
    """A per-token array of the whole batch, as fp32 in the micro-batch's flat token order."""
    values = np.ascontiguousarray(array[mb.token_index], dtype=np.float32)
    return torch.from_numpy(values).to(device)


def batch_loss_weights(batch: PackedBatch) -> npt.NDArray[np.float32]:
    """`batch.loss_weights`, or by default the token mean over `loss_mask`."""
    if batch.loss_weights is not None:
        return batch.loss_weights
    weights: npt.NDArray[np.float32] = batch.loss_mask / max(float(batch.loss_mask.sum()), 1.0)
    return weights


def loss_inputs(
    batch: PackedBatch,
    weights: npt.NDArray[np.float32],
    mb: MicroBatch,
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    device: torch.device,
) -> LossInputs:
    """A loss plugin's inputs for one micro-batch (any train backend): the batch's per-token
    arrays in its order, `old_logprobs` defaulting to the current ones (detached), and zero
    weights on a padding micro-batch."""

    def take(array: npt.NDArray[np.float32] | None) -> torch.Tensor | None:
        return None if array is None else per_token(array, mb, device)

    w = per_token(weights, mb, device)
    old = take(batch.old_logprobs)
    return LossInputs(
        logprobs=logprobs,
        old_logprobs=logprobs.detach() if old is None else old,
        rollout_logprobs=per_token(batch.rollout_logprobs, mb, device),
        advantages=per_token(batch.advantages, mb, device),
        loss_mask=per_token(batch.loss_mask, mb, device),
        loss_weights=torch.zeros_like(w) if mb.is_padding else w,
        entropy=entropy,
        ref_logprobs=take(batch.ref_logprobs),
        seq_index=mb.seq_index,
    )
