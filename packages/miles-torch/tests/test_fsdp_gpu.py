"""The FSDP2 trainer on one CUDA GPU (nccl): bf16 mixed precision, and sleep/wake."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import PackedBatch, Sample
from miles.torch.testing import make_tiny_model, make_trainer
from miles.torch.train.fsdp import FSDPTrainer

pytestmark = pytest.mark.gpu
VOCAB = 512


def sft(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -inputs.logprobs, {}


def make_batch() -> PackedBatch:
    rng = np.random.default_rng(0)
    shapes = [(16, 48), (40, 8), (5, 120), (30, 30)]
    samples = [
        Sample(
            prompt_ids=rng.integers(0, VOCAB, p).tolist(),
            response_ids=rng.integers(0, VOCAB, r).tolist(),
        )
        for p, r in shapes
    ]
    return PackedBatch.from_samples(samples)


@pytest.fixture
def trainers(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = make_tiny_model(
        tmp_path / "tiny", vocab_size=VOCAB, hidden_size=256, num_hidden_layers=4
    )
    made: list[FSDPTrainer] = []

    def make(**cfg) -> FSDPTrainer:
        trainer = make_trainer(path, master_port=port, device="cuda", micro_batch_tokens=128, **cfg)
        made.append(trainer)
        return trainer

    yield path, make
    for trainer in reversed(made):
        trainer.close()


def test_bf16_logprobs_and_learning(trainers):
    path, make = trainers
    batch = make_batch()
    fp32, bf16 = make(lr=1e-3), make(lr=1e-3, dtype="bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    want = np.zeros(len(batch.tokens), dtype=np.float32)
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        ids = torch.from_numpy(batch.tokens[lo:hi]).cuda()[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=ids).logits[0].float(), -1)
        want[lo + 1 : hi] = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1).cpu().numpy()
    np.testing.assert_allclose(fp32.logprobs(batch).logprobs, want, atol=1e-4, rtol=0)
    got = bf16.logprobs(batch).logprobs
    assert np.abs(got - want).max() < 0.25 and np.abs(got - want).mean() < 0.03
    losses = [bf16.train_step(batch, sft)["train/loss"] for _ in range(5)]
    assert losses[-1] < losses[0] - 0.1
    _, tensor = next(iter(bf16.named_weights()))
    assert tensor.is_cuda and tensor.dtype == torch.float32  # fp32 master weights


def gpu_state(trainer: FSDPTrainer) -> list[torch.Tensor]:
    """The local shards of weights, reference weights and Adam moments."""
    params = [*trainer.model.parameters(), *trainer.ref_model.parameters()]
    moments = [v for st in trainer.optimizer.state.values() for k, v in st.items() if k != "step"]
    return [t.to_local() for t in params + moments]


def test_sleep_frees_the_gpu_and_wake_resumes_exactly(trainers):
    _, make = trainers
    batch = make_batch()
    sleeper, control = make(lr=1e-3, reference=True), make(lr=1e-3, reference=True)
    for trainer in (sleeper, control):
        trainer.train_step(batch, sft)  # creates the optimizer state
    resident = sum(t.numel() * t.element_size() for t in gpu_state(sleeper))
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    sleeper.sleep()
    assert not any(t.is_cuda for t in gpu_state(sleeper))
    assert awake - torch.cuda.memory_allocated() >= 0.95 * resident
    sleeper.wake()
    assert all(t.is_cuda for t in gpu_state(sleeper))
    assert torch.cuda.memory_allocated() == pytest.approx(awake, rel=0.01)
    # The optimizer still holds the model's own parameters (moved in place, not replaced).
    assert all(
        p is q
        for p, q in zip(
            sleeper.optimizer.param_groups[0]["params"], sleeper.model.parameters(), strict=True
        )
    )
    assert sleeper.train_step(batch, sft) == control.train_step(batch, sft)
    for (name, a), (_, b) in zip(sleeper.named_weights(), control.named_weights(), strict=True):
        assert torch.equal(a, b), name


def test_offloaded_reference_equals_the_copy_on_gpu(trainers) -> None:
    _, make = trainers
    batch = make_batch()
    copy = make(lr=1e-3, reference=True, ref_mode="copy")
    offload = make(lr=1e-3, reference=True, ref_mode="offload")
    for _ in range(2):
        a, b = copy.logprobs(batch), offload.logprobs(batch)
        np.testing.assert_array_equal(a.ref_logprobs, b.ref_logprobs)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        copy.train_step(batch, sft)
        offload.train_step(batch, sft)
    assert np.abs(a.ref_logprobs - a.logprobs).max() > 1e-4


def _mse(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    assert inputs.values is not None and inputs.returns is not None
    return 0.5 * (inputs.values - inputs.returns).square(), {}


def test_critic_learns_and_survives_sleep_on_gpu(trainers) -> None:
    _, make = trainers
    batch = make_batch()
    trainer = make(lr=1e-3, critic=True)
    batch.returns = (batch.loss_mask * 0.5).astype(np.float32)
    before = trainer.values(batch)
    for _ in range(5):
        trainer.train_value_step(batch, _mse)
    mask = batch.loss_mask > 0
    after = trainer.values(batch)
    err = lambda v: float(((v - batch.returns) ** 2)[mask].mean())  # noqa: E731
    assert err(after) < 0.5 * err(before)
    params = [*trainer.model.parameters(), *trainer.critic.parameters()]
    moments = [
        v
        for opt in (trainer.optimizer, trainer.critic_optimizer)
        for st in opt.state.values()
        for k, v in st.items()
        if k != "step"
    ]
    resident = sum(t.numel() * t.element_size() for t in params + moments)
    del params, moments  # hold no reference to GPU storage while measuring
    torch.cuda.synchronize()
    awake = torch.cuda.memory_allocated()
    trainer.sleep()
    # Policy, critic and both optimizers' state left the GPU.
    assert awake - torch.cuda.memory_allocated() >= 0.95 * resident
    trainer.wake()
    np.testing.assert_array_equal(trainer.values(batch), after)
