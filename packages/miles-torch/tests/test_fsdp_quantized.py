"""Quantized precisions in the FSDP trainer: training really runs in the format, and what the
engines receive (and the checksum that verifies it) follows the trained weights."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.precision.config import Int4QATConfig, QuantConfig
from miles.precision.quantized import (
    QuantizedPrecision,
    fp8_precision,
    int4_qat_precision,
    mxfp8_precision,
)
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.testing import make_tiny_model

from .test_fsdp import SHAPES, VOCAB, make_batch, sft

torch.set_num_threads(1)

PRECISIONS: dict[str, Callable[[], QuantizedPrecision]] = {
    "fp8": lambda: fp8_precision(QuantConfig()),
    "mxfp8": lambda: mxfp8_precision(QuantConfig()),
    "int4-qat": lambda: int4_qat_precision(Int4QATConfig()),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", vocab_size=VOCAB)


def _plain_logprobs(path: str, tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Full-precision logprobs of each packed sequence (0 at its first token)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = np.zeros(len(tokens), dtype=np.float32)
    for lo, hi in itertools.pairwise(offsets):
        ids = torch.from_numpy(tokens[lo:hi])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        out[lo + 1 : hi] = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).numpy()
    return out


def _sync(trainer: Any, engine: TorchRolloutEngine) -> dict[str, torch.Tensor]:
    """Colocated-style sync on CPU; returns what went over the wire (quantized codes, scales)."""
    plan = trainer.weight_sync_plan(1 << 20)
    trainer.send_weights_in_place(plan, lambda i, h: engine.load_bucket(plan, i, h))
    engine.set_weight_version(engine.weight_version + 1)
    return {n: t.clone() for n, t in trainer.weights.rollout_weights()}


@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_training_runs_in_the_format_and_engines_get_the_trained_weights(
    model_path: str, make_trainer: Callable[..., Any], name: str
) -> None:
    precision = PRECISIONS[name]()
    trainer = make_trainer(model_path, precision=precision, quantized=True, lr=1e-2)
    batch = make_batch(SHAPES, seed=5)
    # The training forward runs through the format's layers: not the full-precision logprobs.
    trained_lp = trainer.logprobs(batch).logprobs
    plain_lp = _plain_logprobs(model_path, batch.tokens, batch.offsets)
    assert np.abs(trained_lp - plain_lp).max() > 1e-3

    engine = TorchRolloutEngine(model_path, dtype="bfloat16", precision=precision)
    before = _sync(trainer, engine)
    checksum_before = trainer.weights_checksum("bfloat16")
    assert engine.weights_checksum() == checksum_before
    for _ in range(3):
        trainer.train_step(batch, sft)
    after = _sync(trainer, engine)
    # The quantized codes and scales the engines receive moved with training, and the
    # verification checksum moved with them (on both sides).
    quantized = [n for n in after if n.endswith("_proj.weight")]
    assert quantized and all(after[n].dtype != torch.float32 for n in quantized)
    assert all(not torch.equal(after[n], before[n]) for n in quantized)
    assert trainer.weights_checksum("bfloat16") != checksum_before
    assert engine.weights_checksum() == trainer.weights_checksum("bfloat16")


def test_a_quantized_precision_that_converts_nothing_is_refused(
    model_path: str, make_trainer: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    precision = PRECISIONS["fp8"]()
    monkeypatch.setattr(precision, "convert_model", lambda model: 0)
    with pytest.raises(ValueError, match="'fp8' converted no layer"):
        make_trainer(model_path, precision=precision, quantized=True)
