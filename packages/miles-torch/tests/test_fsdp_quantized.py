"""Quantized precisions in the FSDP trainer: training really runs in the format, and what the
engines receive (and the checksum that verifies it) follows the trained weights."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from miles.core.config import LoRAConfig
from miles.core.contracts.types import GenerateRequest, PackedBatch, Sample, SamplingParams
from miles.precision.config import Int4QATConfig, QuantConfig
from miles.precision.quantized import (
    QuantizedPrecision,
    fp8_precision,
    int4_qat_precision,
    mxfp8_precision,
)
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.testing import make_tiny_model, sync_in_place

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
    sync_in_place(trainer, engine)
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


# Mean |trainer - engine| logprob each LoRA-over-quantized combination stays within (the bounds
# tests/test_precisions.py held end to end): with adapters, the engine's base is exactly what
# training quantizes (int4) or skips only training's activation quantization (fp8, mxfp8); merged,
# base + adapters is quantized again for the engine, which can move a weight by a whole step.
LORA_MISMATCH = {("int4-qat", "adapters"): 0.02, ("fp8", "adapters"): 0.1}
LORA_MISMATCH |= {("mxfp8", "adapters"): 0.1} | {(n, "merged"): 0.2 for n in PRECISIONS}


def _rollout(engine: TorchRolloutEngine, seed: int) -> tuple[PackedBatch, np.ndarray]:
    """A batch the engine generated (sampled at temperature 1, as RL does), and its logprobs."""
    g = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    requests = [
        GenerateRequest(i, torch.randint(3, VOCAB, (n,), generator=g).tolist(), sampling)
        for i, n in enumerate([4, 7, 3, 9])
    ]
    results = sorted(engine.results(requests), key=lambda r: r.request_id)
    samples = [
        Sample(
            prompt_ids=req.prompt_ids,
            response_ids=res.response_ids,
            rollout_logprobs=res.logprobs,
            sample_id=req.request_id,
        )
        for req, res in zip(requests, results, strict=True)
    ]
    batch = PackedBatch.from_samples(samples, advantages=[1.0, -1.0, 0.5, -0.5])
    return batch, batch.rollout_logprobs


@pytest.mark.parametrize("sync", ["merged", "adapters"])
@pytest.mark.parametrize("name", sorted(PRECISIONS))
def test_lora_over_a_quantized_precision_trains_adapters_and_engines_follow(
    model_path: str, make_trainer: Callable[..., Any], tmp_path: Any, name: str, sync: str
) -> None:
    """LoRA over quantized projections (QLoRA-style for int4), both sync modes: the adapters
    train, every sync verifies (the engine's checksum of what it serves is the trainer's), the
    engine samples within the format's mismatch bound of the trainer, and a checkpoint holds
    the adapters only. The same path as `miles run` with `precision: P, lora: {sync: S}`."""
    precision = PRECISIONS[name]()
    lora = LoRAConfig(rank=4, sync=sync)  # type: ignore[arg-type]
    trainer = make_trainer(model_path, precision=precision, quantized=True, lora=lora, lr=1e-3)
    engine = TorchRolloutEngine(
        model_path,
        dtype="bfloat16",
        precision=precision,
        lora=lora if sync == "adapters" else None,
    )
    sent = _sync(trainer, engine)
    assert engine.weights_checksum() == trainer.weights_checksum("bfloat16")
    if sync == "adapters":  # a small part of the bytes: the adapters alone
        assert sent and all(".lora_" in n for n in sent)
    for step in range(3):
        batch, rollout_lp = _rollout(engine, seed=step)
        trained_lp = trainer.logprobs(batch).logprobs
        mask = batch.loss_mask > 0
        mismatch = float(np.abs(trained_lp - rollout_lp)[mask].mean())
        assert mismatch < LORA_MISMATCH[name, sync], (step, mismatch)
        metrics = trainer.train_step(batch, sft)
        assert metrics["train/grad_norm"] > 0
        _sync(trainer, engine)
        assert engine.weights_checksum() == trainer.weights_checksum("bfloat16"), step
    trainer.save(str(tmp_path / "ckpt"))
    files = {p.name for p in (tmp_path / "ckpt").rglob("*.safetensors")}
    assert "adapter.safetensors" in files and "model.safetensors" not in files
    (adapter_file,) = (tmp_path / "ckpt").rglob("adapter.safetensors")
    adapters = load_file(str(adapter_file))
    b_names = [n for n in adapters if n.endswith(".lora_B.weight")]
    assert b_names
    for b in b_names:  # every adapter moved the policy off its base (B starts at zero)
        a = adapters[b.replace(".lora_B.", ".lora_A.")]
        assert (adapters[b].float() @ a.float()).abs().max() > 0, b
