"""Routing records stay aligned with their tokens through shuffling, packing, micro-batching,
right-padding and the split over data-parallel ranks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from miles.core.contracts.types import PackedBatch, Sample
from miles.torch.train.microbatch import shard_micro_batches

LAYERS, TOP_K = 3, 2


def _code(sample_id: int, position: int, layer: int, slot: int) -> int:
    return sample_id * 10_000 + position * 100 + layer * 10 + slot


def _sample(sample_id: int, rng: random.Random) -> Sample:
    prompt, response = rng.randint(2, 9), rng.randint(1, 12)
    n = prompt + response
    routing = np.array(
        [
            [[_code(sample_id, t, layer, k) for k in range(TOP_K)] for layer in range(LAYERS)]
            for t in range(n)
        ],
        dtype=np.int32,
    )
    weights = (routing % 997).astype(np.float32) / 997
    return Sample(
        prompt_ids=[rng.randint(4, 100) for _ in range(prompt)],
        response_ids=[rng.randint(4, 100) for _ in range(response)],
        rollout_logprobs=[-1.0] * response,
        sample_id=sample_id,
        routing=routing,
        routing_weights=weights,
    )


def test_records_follow_their_tokens_into_every_micro_batch_and_rank() -> None:
    rng = random.Random(0)
    samples = [_sample(i, rng) for i in range(23)]
    rng.shuffle(samples)
    batch = PackedBatch.from_samples(samples)
    assert batch.routing is not None and batch.routing.shape == (len(batch.tokens), LAYERS, TOP_K)
    batch = batch.select(np.random.default_rng(1).permutation(len(batch)))  # and once more
    seen_tokens = 0
    for rank in range(2):
        for mb in shard_micro_batches(batch, 40, rank, 2, torch.device("cpu")):
            assert mb.routing is not None and mb.routing_weights is not None
            rows, width = mb.input_ids.shape
            block = mb.routing.view(rows, width, LAYERS, TOP_K).numpy()
            block_w = mb.routing_weights.view(rows, width, LAYERS, TOP_K).numpy()
            mask = mb.attention_mask.numpy().astype(bool)
            assert (block[~mask] == -1).all()  # padding carries no record
            starts = np.searchsorted(batch.offsets, mb.token_index, side="right") - 1
            flat_rows = mb.seq_index.numpy()
            cols = np.concatenate([np.arange(n) for n in np.bincount(flat_rows)])
            for j, b in enumerate(mb.token_index):
                seq = starts[j]
                sid, pos = int(batch.sample_ids[seq]), int(b - batch.offsets[seq])
                expected = [
                    [_code(sid, pos, layer, k) for k in range(TOP_K)] for layer in range(LAYERS)
                ]
                assert block[flat_rows[j], cols[j]].tolist() == expected
                assert mb.input_ids[flat_rows[j], cols[j]] == batch.tokens[b]
                np.testing.assert_allclose(
                    block_w[flat_rows[j], cols[j]], (np.array(expected) % 997) / 997, rtol=1e-6
                )
            if not mb.is_padding:
                seen_tokens += len(mb.token_index)
    assert seen_tokens == len(batch.tokens)  # every token in exactly one real micro-batch


def test_a_record_of_the_wrong_length_is_refused() -> None:
    sample = _sample(0, random.Random(0))
    sample.routing = sample.routing[:-1]  # type: ignore[index]
    with pytest.raises(ValueError, match="routing has"):
        PackedBatch.from_samples([sample])
