import numpy as np
import pytest

from miles.core.contracts.types import PackedBatch, Sample, split_by_token_budget


def test_split_by_token_budget_keeps_order_and_isolates_oversize() -> None:
    assert split_by_token_budget([3, 3, 3, 10, 2], budget=6) == [[0, 1], [2], [3], [4]]
    assert split_by_token_budget([], budget=4) == []
    with pytest.raises(ValueError, match="positive"):
        split_by_token_budget([1], budget=0)


def test_packed_batch_roundtrip_and_select() -> None:
    samples = [
        Sample(prompt_ids=[1, 2], response_ids=[3], rollout_logprobs=[-0.5], sample_id=10),
        Sample(
            prompt_ids=[4],
            response_ids=[5, 6],
            rollout_logprobs=[-1.0, -2.0],
            loss_mask=[1, 0],
            sample_id=11,
            group_id=1,
            reward=1.0,
        ),
    ]
    batch = PackedBatch.from_samples(samples, advantages=[0.5, -1.0])
    assert batch.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert batch.offsets.tolist() == [0, 3, 6]
    assert batch.loss_mask.tolist() == [0, 0, 1, 0, 1, 0]
    assert batch.advantages.tolist() == [0, 0, 0.5, 0, -1.0, -1.0]
    assert batch.rollout_logprobs.tolist() == [0, 0, -0.5, 0, -1.0, -2.0]
    picked = batch.select([1])
    assert picked.tokens.tolist() == [4, 5, 6] and picked.sample_ids.tolist() == [11]
    assert np.array_equal(picked.rewards, [1.0])


def test_loss_mask_length_is_checked() -> None:
    bad = Sample(prompt_ids=[1], response_ids=[2, 3], loss_mask=[1])
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 response tokens"):
        PackedBatch.from_samples([bad])
