"""The FSDP2 trainer's critic (value model): value alignment, learning, 2 ranks vs 1, resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import PackedBatch, Sample
from miles.runtime.cluster.process import free_port
from miles.torch.testing import make_tiny_model
from miles.torch.train.config import FSDPConfig
from miles.torch.train.fsdp import FSDPTrainer
from miles.torch.train.microbatch import plan_micro_batches
from miles.torch.train.optim import lr_at

torch.set_num_threads(1)
VOCAB = 128
SHAPES = [(3, 6), (8, 1), (1, 0), (5, 20), (4, 4), (2, 9)]  # a 25-token and a 1-token sequence
BUDGET = 12  # several micro-batches; the dist worker's micro_batch_tokens
WORKER = Path(__file__).with_name("fsdp_critic_worker.py")


def mse(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    assert inputs.values is not None and inputs.returns is not None
    assert inputs.old_values is not None and not inputs.logprobs.requires_grad
    err = (inputs.values - inputs.returns).square()
    moved = (inputs.values - inputs.old_values).detach().abs()
    return 0.5 * err, {"train/value_error": err.detach(), "moved": moved}


def policy_sft(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -inputs.logprobs, {}


def make_batch(seed: int = 0) -> PackedBatch:
    """Random tokens; returns are a per-sequence level plus a ramp over the response."""
    rng = np.random.default_rng(seed)
    samples = [
        Sample(
            prompt_ids=rng.integers(0, VOCAB, p).tolist(),
            response_ids=rng.integers(0, VOCAB, r).tolist(),
            sample_id=i,
        )
        for i, (p, r) in enumerate(SHAPES)
    ]
    batch = PackedBatch.from_samples(samples)
    returns = np.zeros(len(batch.tokens), dtype=np.float32)
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        returns[lo:hi] = (-1.0) ** i + np.linspace(0.0, 0.5, hi - lo)
    batch.returns = returns * batch.loss_mask
    return batch


def weighted_error(batch: PackedBatch, values: np.ndarray) -> float:
    assert batch.returns is not None
    mask = batch.loss_mask
    return float((0.5 * (values - batch.returns) ** 2 * mask).sum() / mask.sum())


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", vocab_size=VOCAB)


def critic_weights(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().clone() for n, p in trainer.critic.named_parameters()}


def policy_weights(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.named_weights()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("arch,tied", [("qwen3", False), ("qwen3", True), ("qwen3_moe", False)])
def test_values_match_a_plain_forward_of_the_saved_critic(arch, tied, make_trainer, tmp_path):
    path = make_tiny_model(tmp_path / arch, arch=arch, vocab_size=VOCAB, tie_word_embeddings=tied)
    batch = make_batch()
    trainer = make_trainer(path, critic=True, micro_batch_tokens=BUDGET)
    values = trainer.values(batch)
    assert values.dtype == np.float32 and values.shape == batch.tokens.shape
    trainer.save(str(tmp_path / "ckpt"))

    # The critic's checkpoint is a Hugging Face token-classification checkpoint: the policy's
    # transformer (untrained so far) plus the value head.
    critic = AutoModelForTokenClassification.from_pretrained(
        tmp_path / "ckpt" / "critic", dtype=torch.float32
    ).eval()
    assert critic.config.num_labels == 1
    policy = dict(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters()
    )
    base = {n: p for n, p in critic.named_parameters() if not n.startswith("score.")}
    assert base and all(torch.equal(p, policy[n]) for n, p in base.items())
    assert critic.score.weight.abs().max() > 0

    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        ids = torch.from_numpy(batch.tokens[lo:hi])[None]
        with torch.no_grad():
            out = critic(input_ids=ids).logits[0, :, 0]
        want = np.zeros(hi - lo, dtype=np.float32)
        want[1:] = out[:-1].numpy()  # the value of token t is the output at t - 1
        np.testing.assert_allclose(values[lo:hi], want, rtol=0, atol=1e-5)
        assert values[lo] == 0.0
    assert (values != 0).sum() == len(batch.tokens) - len(batch)  # all filled in


def test_value_steps_reduce_the_error_and_leave_the_policy_alone(model_path, make_trainer):
    batch = make_batch(seed=1)
    cfg = dict(lr=1e-6, critic=True, critic_lr=3e-3, lr_schedule="cosine", total_steps=8)
    trainer = make_trainer(model_path, micro_batch_tokens=BUDGET, **cfg)
    policy_before = policy_weights(trainer)
    critic_before = critic_weights(trainer)
    first = trainer.values(batch)
    initial = weighted_error(batch, first)
    history = [trainer.train_value_step(batch, mse) for _ in range(8)]
    final = weighted_error(batch, trainer.values(batch))

    assert history[0].keys() == {
        "critic/loss",
        "critic/value_error",
        "critic/moved",
        "critic/grad_norm",
        "critic/lr",
    }
    # The first step's loss is that of the values `values` reports, and old_values default to them.
    assert history[0]["critic/loss"] == pytest.approx(initial, rel=1e-5)
    assert history[0]["critic/value_error"] == pytest.approx(2 * initial, rel=1e-5)
    assert history[0]["critic/moved"] == 0.0
    assert final < 0.3 * initial, (initial, final)
    assert [m["critic/lr"] for m in history] == [
        lr_at(FSDPConfig(**{k: v for k, v in cfg.items() if k != "critic"}), s, 3e-3)
        for s in range(8)
    ]
    assert trainer.critic_step == 8 and trainer.step == 0
    assert max_diff(policy_weights(trainer), policy_before) == 0.0
    assert max_diff(critic_weights(trainer), critic_before) > 1e-3

    # Scored values (batch.values) reach the loss as old_values.
    batch.values = trainer.values(batch) + batch.loss_mask
    assert trainer.train_value_step(batch, mse)["critic/moved"] == pytest.approx(1.0, rel=1e-5)

    # The policy step is untouched by the critic: it still trains the policy alone.
    critic_now = critic_weights(trainer)
    trainer.train_step(batch, policy_sft)
    assert trainer.step == 1 and max_diff(critic_weights(trainer), critic_now) == 0.0


def test_critic_calls_need_a_critic_and_returns(model_path, make_trainer):
    batch = make_batch()
    trainer = make_trainer(model_path, micro_batch_tokens=BUDGET)
    assert trainer.critic is None
    with pytest.raises(RuntimeError, match="no critic"):
        trainer.values(batch)
    with_critic = make_trainer(model_path, critic=True, micro_batch_tokens=BUDGET)
    batch.returns = None
    with pytest.raises(ValueError, match="returns"):
        with_critic.train_value_step(batch, mse)


def test_checkpoint_with_critic_resumes_exactly(model_path, make_trainer, tmp_path):
    batch = make_batch()
    cfg = dict(
        lr=1e-3,
        critic=True,
        critic_lr=1e-2,
        lr_schedule="cosine",
        warmup_steps=1,
        total_steps=5,
        micro_batch_tokens=16,
    )
    first = make_trainer(model_path, **cfg)
    first.train_value_step(batch, mse)
    first.train_value_step(batch, mse)
    first.train_step(batch, policy_sft)
    ckpt = tmp_path / "ckpt"
    first.save(str(ckpt))
    value_step = first.train_value_step(batch, mse)
    policy_step = first.train_step(batch, policy_sft)

    resumed = make_trainer(model_path, **cfg)
    resumed.load(str(ckpt))
    assert (resumed.critic_step, resumed.step) == (2, 1)
    assert resumed.train_value_step(batch, mse) == value_step
    assert resumed.train_step(batch, policy_sft) == policy_step
    assert max_diff(critic_weights(resumed), critic_weights(first)) == 0.0
    assert max_diff(policy_weights(resumed), policy_weights(first)) == 0.0
    np.testing.assert_array_equal(resumed.values(batch), first.values(batch))

    critic_dir = ckpt / "critic"
    files = {p.name for p in critic_dir.iterdir()}
    assert files == {"model.safetensors", "optimizer.safetensors", "config.json"}
    assert not [p for p in ckpt.rglob("*") if p.suffix in {".pt", ".pth", ".bin", ".pkl"}]
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert (state["step"], state["critic_step"]) == (1, 2)
    with safe_open(str(critic_dir / "optimizer.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    params = [n for n, _ in first.critic.named_parameters()]
    assert keys == {f"{n}/{k}" for n in params for k in ("step", "exp_avg", "exp_avg_sq")}

    # A policy-only checkpoint cannot silently resume a critic run.
    plain = make_trainer(model_path, micro_batch_tokens=16)
    plain.save(str(tmp_path / "plain"))
    with pytest.raises(ValueError, match="no critic"):
        resumed.load(str(tmp_path / "plain"))


def run_ranks(model: str, batch_file: Path, out: Path, world: int, resume: str = "") -> None:
    out.mkdir()
    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [model, str(batch_file), str(out)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args, str(rank), str(world), port]
            + ([resume] if resume else []),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    for rank, proc in enumerate(procs):
        try:
            log, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, f"rank {rank} of {world} failed:\n{log[-4000:]}"


def test_two_ranks_match_one_rank_for_value_steps(model_path, tmp_path):
    batch = make_batch()
    # Scored values away from the current ones, so that the clipped loss clips.
    rng = np.random.default_rng(2)
    batch.values = (0.3 * rng.standard_normal(len(batch.tokens))).astype(np.float32)
    weights = np.zeros_like(batch.loss_mask)  # sequence-mean aggregation, not the default
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        mask = batch.loss_mask[lo:hi]
        weights[lo:hi] = mask / max(mask.sum(), 1.0) / len(batch)
    batch.loss_weights = weights
    # An odd number of micro-batches: rank 1 runs a padding micro-batch.
    assert len(plan_micro_batches(batch.seq_lens, BUDGET)) % 2 == 1
    batch_file = tmp_path / "batch.npz"
    np.savez(batch_file, **{k: v for k, v in vars(batch).items() if v is not None})

    run_ranks(model_path, batch_file, tmp_path / "two", world=2)
    run_ranks(model_path, batch_file, tmp_path / "one", world=1)
    resume = str(tmp_path / "two" / "ckpt")
    run_ranks(model_path, batch_file, tmp_path / "resumed", world=1, resume=resume)

    def metrics(run: str, rank: int = 0) -> list[dict[str, float]]:
        return json.loads((tmp_path / run / f"metrics_rank{rank}.json").read_text())

    assert metrics("two", 0) == metrics("two", 1)  # every rank reports the same numbers
    for two, one in zip(metrics("two"), metrics("one"), strict=True):
        assert (
            two.keys()
            == one.keys()
            == {
                "critic/loss",
                "critic/value_error",
                "critic/grad_norm",
                "critic/lr",
            }
        )
        for key in two:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-7), key
    assert metrics("one")[2]["critic/loss"] < metrics("one")[0]["critic/loss"]

    two, one, resumed = (
        load_file(tmp_path / r / "result.safetensors") for r in ("two", "one", "resumed")
    )
    assert two.keys() == one.keys() == resumed.keys()
    np.testing.assert_allclose(two["__values__"], one["__values__"], rtol=0, atol=1e-6)
    initial = load_file(tmp_path / "two" / "ckpt" / "critic" / "model.safetensors")
    assert max((one[k] - initial[k]).abs().max().item() for k in initial) > 1e-3  # it trained
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)
        # A 2-rank checkpoint resumes on 1 rank: the third step lands where the 2-rank one did.
        torch.testing.assert_close(resumed[name], two[name], rtol=1e-5, atol=1e-6, msg=name)
    assert metrics("resumed")[0] == pytest.approx(metrics("two")[2], rel=1e-5, abs=1e-7)


def test_select_carries_values_and_returns():
    batch = make_batch()
    batch.values = np.arange(len(batch.tokens), dtype=np.float32)
    part = batch.select([3, 0])
    lo, hi = batch.offsets[3], batch.offsets[4]
    np.testing.assert_array_equal(part.values[: hi - lo], batch.values[lo:hi])
    np.testing.assert_array_equal(part.returns[: hi - lo], batch.returns[lo:hi])
    assert batch.select([1]).loss_weights is None
