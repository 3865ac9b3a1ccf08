"""A colocated sync's checksum comes from the buckets as they were sent, and only while the
weights are the ones sent: the same hex digest as hashing the trainer's weights afresh."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from miles.precision.dtype import bf16
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.sync import sender
from miles.torch.testing import make_tiny_model

from .test_fsdp import SHAPES, VOCAB, make_batch, sft


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", vocab_size=VOCAB)


def test_sent_checksum_equals_a_fresh_one_and_goes_stale_with_training(
    model_path: str, make_trainer: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = make_trainer(model_path, precision=bf16(), lr=1e-2)
    engine = TorchRolloutEngine(model_path, dtype="bfloat16")
    hashed_afresh = []
    fresh = sender.tensors_checksum
    monkeypatch.setattr(
        sender, "tensors_checksum", lambda named: hashed_afresh.append(1) or fresh(named)
    )

    def sync() -> None:
        plan = trainer.weight_sync_plan(1 << 16)  # several buckets
        trainer.send_weights_in_place(plan, lambda i, h: engine.load_bucket(plan, i, h))

    sync()
    sent = trainer.weights_checksum("bfloat16")
    assert not hashed_afresh  # taken from the buckets
    assert sent == engine.weights_checksum()
    trainer.weights.weights_changed()
    assert trainer.weights_checksum("bfloat16") == sent and hashed_afresh == [1]
    # Another dtype than the buckets': hashed afresh.
    assert trainer.weights_checksum("float32") != sent and hashed_afresh == [1, 1]

    sync()
    trainer.train_step(make_batch(SHAPES), sft)  # the weights move: the sent hash is stale
    trained = trainer.weights_checksum("bfloat16")
    assert len(hashed_afresh) == 3 and trained != sent
    sync()
    assert trainer.weights_checksum("bfloat16") == trained == engine.weights_checksum()
    assert len(hashed_afresh) == 3


def test_no_bucket_hashing_when_the_run_does_not_verify(
    model_path: str, make_trainer: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.verify_weights: false: a sync hashes nothing (the hash would never be asked for)."""
    trainer = make_trainer(model_path, precision=bf16(), verify_weights=False)
    engine = TorchRolloutEngine(model_path, dtype="bfloat16")
    added = []
    real_add = sender.Checksum.add
    monkeypatch.setattr(
        sender.Checksum, "add", lambda self, n, t: added.append(n) or real_add(self, n, t)
    )
    plan = trainer.weight_sync_plan(1 << 16)
    trainer.send_weights_in_place(plan, lambda i, h: engine.load_bucket(plan, i, h))
    assert not added
    # Asked anyway, it is hashed afresh and still right.
    assert trainer.weights_checksum("bfloat16") == engine.weights_checksum()
