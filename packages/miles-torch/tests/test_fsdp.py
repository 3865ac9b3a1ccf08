"""The FSDP2 trainer on one CPU rank (gloo): logprobs, micro-batching, checkpoints, learning."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from miles.core.contracts.protocols import LossInputs
from miles.core.contracts.types import PackedBatch, Sample
from miles.torch.testing import make_tiny_model
from miles.torch.train.config import FSDPConfig
from miles.torch.train.fsdp import FSDPTrainer
from miles.torch.train.microbatch import plan_micro_batches
from miles.torch.train.optim import lr_at

torch.set_num_threads(1)
VOCAB = 128


def ppo_clip(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * inputs.advantages, clipped * inputs.advantages)
    return loss, {"clipfrac": (ratio != clipped).float()}


def sft(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return -inputs.logprobs, {}


def make_batch(shapes: list[tuple[int, int]], seed: int = 0) -> PackedBatch:
    """(prompt_len, response_len) per sample; random tokens, alternating-sign advantages."""
    rng = np.random.default_rng(seed)
    samples = [
        Sample(
            prompt_ids=rng.integers(0, VOCAB, p).tolist(),
            response_ids=rng.integers(0, VOCAB, r).tolist(),
            sample_id=i,
        )
        for i, (p, r) in enumerate(shapes)
    ]
    adv = [(-1.0) ** i * (0.5 + 0.25 * i) for i in range(len(samples))]
    return PackedBatch.from_samples(samples, advantages=adv)


SHAPES = [(3, 6), (8, 1), (1, 0), (5, 20), (4, 4), (2, 9)]  # a 25-token and a 1-token sequence


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), arch="qwen3", vocab_size=VOCAB)


def weights(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in trainer.named_weights()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_logprobs_match_transformers_forward(model_path, make_trainer):
    temperature = 0.7
    batch = make_batch(SHAPES)
    # A budget of 12 tokens: several micro-batches, and the 25-token sequence alone in one.
    trainer = make_trainer(model_path, micro_batch_tokens=12, temperature=temperature)
    out = trainer.logprobs(batch)
    assert out.ref_logprobs is None and out.metrics == {}  # no reference, no MoE routers
    assert out.logprobs.dtype == np.float32 and out.logprobs.shape == batch.tokens.shape

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        ids = torch.from_numpy(batch.tokens[lo:hi])[None]
        with torch.no_grad():
            logp = torch.log_softmax(hf(input_ids=ids).logits[0].float() / temperature, -1)
        want = torch.zeros(hi - lo)
        want[1:] = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
        want_entropy = torch.zeros(hi - lo)
        want_entropy[1:] = -(logp.exp() * logp).sum(-1)[:-1]
        np.testing.assert_allclose(out.logprobs[lo:hi], want.numpy(), rtol=0, atol=1e-5)
        np.testing.assert_allclose(out.entropy[lo:hi], want_entropy.numpy(), rtol=0, atol=1e-5)
        assert out.logprobs[lo] == 0.0 and out.entropy[lo] == 0.0
    assert (out.logprobs[1:] != 0).sum() == len(batch.tokens) - len(batch)  # all filled in


def test_micro_batching_and_activation_checkpointing_do_not_change_the_step(
    model_path, make_trainer
):
    batch = make_batch(SHAPES)
    rng = np.random.default_rng(1)
    results = []
    for budget, recompute in [(10**6, False), (7, False), (7, True)]:
        # Adam's first step is lr * sign(grad) where |grad| >> eps: a grad within rounding of 0
        # could flip a weight by 2 * lr. A large eps makes the update smooth in the grad.
        trainer = make_trainer(
            model_path,
            lr=1e-2,
            eps=1e-3,
            micro_batch_tokens=budget,
            activation_checkpointing=recompute,
        )
        if not results:  # the same off-policy old logprobs for every run: some ratios clip
            old = trainer.logprobs(batch).logprobs
            batch.old_logprobs = old + 0.3 * rng.standard_normal(old.shape).astype(np.float32)
        attention_calls = []
        trainer.model.model.layers[0].self_attn.register_forward_pre_hook(
            lambda *_, calls=attention_calls: calls.append(1)
        )
        metrics = trainer.train_step(batch, ppo_clip)
        micro_batches = len(plan_micro_batches(batch.seq_lens, budget))
        assert len(attention_calls) == micro_batches * (2 if recompute else 1)
        results.append((metrics, weights(trainer)))
        trainer.close()

    (ref_metrics, ref_weights), *others = results
    assert 0.0 < ref_metrics["train/clipfrac"] < 1.0
    assert max_diff(ref_weights, weights_before(model_path)) > 1e-4  # the step did something
    for metrics, w in others:
        assert metrics.keys() == ref_metrics.keys()
        for key in ("train/loss", "train/entropy", "train/clipfrac", "train/grad_norm"):
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-6), key
        assert max_diff(w, ref_weights) < 1e-5


def weights_before(model_path: str) -> dict[str, torch.Tensor]:
    return dict(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).named_parameters()
    )


def test_sft_steps_reduce_the_loss_and_follow_the_lr_schedule(model_path, make_trainer):
    batch = make_batch(SHAPES, seed=3)
    cfg = dict(lr=3e-3, lr_schedule="cosine", warmup_steps=2, total_steps=8, micro_batch_tokens=16)
    trainer = make_trainer(model_path, **cfg)
    first = trainer.logprobs(batch).logprobs
    nll_before = -(first * batch.loss_mask).sum() / batch.loss_mask.sum()
    history = [trainer.train_step(batch, sft) for _ in range(8)]
    losses = [m["train/loss"] for m in history]
    # The first step's loss is the masked mean NLL of the untouched model.
    assert losses[0] == pytest.approx(float(nll_before), rel=1e-5)
    assert losses[-1] < 0.5 * losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert [m["train/lr"] for m in history] == [lr_at(FSDPConfig(**cfg), s) for s in range(8)]
    assert trainer.step == 8


def test_the_run_sets_total_steps_unless_the_config_does(model_path, make_trainer):
    with pytest.raises(ValueError, match="total_steps > warmup_steps"):
        make_trainer(model_path, lr_schedule="linear")  # the run plans no step at all
    trainer = make_trainer(model_path, lr_schedule="linear", total_steps=6)  # TrainSetup's
    assert trainer.cfg.total_steps == 6


def test_config_and_lr_schedules():
    cos = FSDPConfig(lr=1.0, lr_schedule="cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [lr_at(cos, s) for s in range(2)] == [0.5, 1.0]
    assert lr_at(cos, 4) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert lr_at(cos, 6) == pytest.approx(0.1) and lr_at(cos, 60) == pytest.approx(0.1)
    lin = FSDPConfig(lr=2.0, lr_schedule="linear", total_steps=4)
    assert [lr_at(lin, s) for s in range(5)] == [2.0, 1.5, 1.0, 0.5, 0.0]
    assert lr_at(FSDPConfig(lr=0.5, warmup_steps=4), 100) == 0.5
    with pytest.raises(ValueError, match="total_steps"):
        FSDPConfig(lr_schedule="cosine", warmup_steps=2, total_steps=2)
    FSDPConfig(lr_schedule="cosine", total_steps=0)  # 0: the run's steps, known at the trainer
    with pytest.raises(ValueError, match="dtype"):
        FSDPConfig(dtype="float16")
    assert FSDPConfig(betas=[0.9, 0.95]).betas == (0.9, 0.95)  # as YAML gives them


@pytest.mark.parametrize("ref_mode", ["copy", "offload"])
def test_reference_model_stays_frozen(model_path, make_trainer, ref_mode):
    batch = make_batch(SHAPES)
    trainer = make_trainer(
        model_path, lr=1e-2, reference=True, ref_mode=ref_mode, micro_batch_tokens=16
    )
    before = trainer.logprobs(batch)
    np.testing.assert_array_equal(before.ref_logprobs, before.logprobs)
    trainer.train_step(batch, sft)
    after = trainer.logprobs(batch)
    np.testing.assert_array_equal(after.ref_logprobs, before.logprobs)
    assert np.abs(after.logprobs - before.logprobs).max() > 1e-3
    trainer.sleep()  # CPU: a no-op; the trainer keeps working
    trainer.wake()
    assert trainer.train_step(batch, sft)["train/loss"] < -float(
        (before.logprobs * batch.loss_mask).sum() / batch.loss_mask.sum()
    )


def test_offloaded_reference_equals_the_frozen_copy(model_path, make_trainer):
    """Swapping host-held reference shards in and out gives the copy's logprobs, and leaves the
    policy exactly as it was: training goes on identically."""
    batch = make_batch(SHAPES)
    copy = make_trainer(model_path, lr=1e-2, reference=True, ref_mode="copy", micro_batch_tokens=16)
    offload = make_trainer(
        model_path, lr=1e-2, reference=True, ref_mode="offload", micro_batch_tokens=16
    )
    for _ in range(3):
        a, b = copy.logprobs(batch), offload.logprobs(batch)
        np.testing.assert_array_equal(a.ref_logprobs, b.ref_logprobs)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
        assert copy.train_step(batch, sft) == offload.train_step(batch, sft)
    assert max_diff(weights(copy), weights(offload)) == 0.0
    assert np.abs(a.ref_logprobs - a.logprobs).max() > 1e-3  # the policy did move


def test_checkpoint_resumes_exactly_without_pickle(model_path, make_trainer, tmp_path):
    batch = make_batch(SHAPES)
    cfg = dict(lr=1e-3, lr_schedule="cosine", warmup_steps=1, total_steps=5, micro_batch_tokens=16)
    first = make_trainer(model_path, **cfg)
    first.train_step(batch, ppo_clip)
    first.train_step(batch, ppo_clip)
    ckpt = tmp_path / "ckpt"
    first.save(str(ckpt))
    saved = weights(first)
    third = first.train_step(batch, ppo_clip)

    resumed = make_trainer(model_path, **cfg)
    resumed.load(str(ckpt))
    assert resumed.step == 2
    assert resumed.train_step(batch, ppo_clip) == third
    assert max_diff(weights(resumed), weights(first)) == 0.0

    files = {p.name for p in ckpt.iterdir()}
    assert {"model.safetensors", "optimizer.safetensors", "config.json"} <= files
    assert not [f for f in files if Path(f).suffix in {".pt", ".pth", ".bin", ".pkl"}]
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 2
    with safe_open(str(ckpt / "optimizer.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    params = [n for n, _ in first.model.named_parameters()]
    assert keys == {f"{n}/{k}" for n in params for k in ("step", "exp_avg", "exp_avg_sq")}
    # The weights file is a Hugging Face checkpoint of the step-2 policy.
    loaded = dict(
        AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).named_parameters()
    )
    assert max_diff(loaded, saved) == 0.0

    first.save(str(ckpt))  # saving over a checkpoint replaces it
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == 3
    assert not list(tmp_path.glob("ckpt.*"))  # no temp or old directories left behind


def test_optimizer_offload_takes_adamws_steps_and_resumes(
    model_path, make_trainer, tmp_path, monkeypatch
):
    """`optimizer_offload` streams AdamW a chunk at a time (here 1,000 parameters, so the tiny
    model takes many chunks): the same steps as plain AdamW, and a checkpoint that resumes."""
    from miles.torch.train import config as train_config
    from miles.torch.train.host_adamw import HostAdamW

    monkeypatch.setattr(train_config, "OPTIMIZER_CHUNK_PARAMS", 1000)
    batch = make_batch(SHAPES)
    cfg = dict(lr=1e-3, micro_batch_tokens=16)
    plain, offloaded = (
        make_trainer(model_path, **cfg),
        make_trainer(model_path, optimizer_offload=True, **cfg),
    )
    assert isinstance(offloaded.optimizer, HostAdamW)
    assert len(list(offloaded.optimizer._chunks())) > 3
    for _ in range(2):
        assert offloaded.train_step(batch, ppo_clip) == plain.train_step(batch, ppo_clip)
    assert max_diff(weights(offloaded), weights(plain)) == 0.0
    offloaded.save(str(tmp_path / "ckpt"))
    third = offloaded.train_step(batch, ppo_clip)
    resumed = make_trainer(model_path, optimizer_offload=True, **cfg)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.train_step(batch, ppo_clip) == third


def test_a_lora_base_is_held_in_bf16_and_computes_the_same(model_path, make_trainer):
    """Under bf16 compute a LoRA trainer keeps its frozen base in bf16 (no fp32 master: half the
    memory) and fp32 adapters; FSDP computed in the base's bf16 before, so the logprobs equal a
    full-parameter bf16 trainer's exactly while B = 0, and a step moves the adapters only."""
    from miles.core.config import LoRAConfig
    from miles.precision.dtype import bf16

    batch = make_batch(SHAPES)
    common = dict(lr=1e-2, micro_batch_tokens=16, dtype="bfloat16", precision=bf16())
    full = make_trainer(model_path, **common)
    lora = make_trainer(model_path, lora=LoRAConfig(rank=4), **common)
    dtypes = {(".lora_" in n, p.dtype) for n, p in lora.model.named_parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}, dtypes
    np.testing.assert_array_equal(lora.logprobs(batch).logprobs, full.logprobs(batch).logprobs)
    before = {n: p.detach().clone() for n, p in lora.model.named_parameters()}
    lora.train_step(batch, ppo_clip)
    moved = {n for n, p in lora.model.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(".lora_" in n for n in moved), moved


@pytest.mark.parametrize("arch,tied", [("qwen3", True), ("qwen3_moe", False)])
def test_checkpoint_keeps_the_hf_on_disk_format(arch, tied, make_trainer, tmp_path):
    """Tied embeddings are stored once; fused MoE experts go back to per-expert tensors."""
    path = make_tiny_model(tmp_path / arch, arch=arch, vocab_size=VOCAB, tie_word_embeddings=tied)
    trainer = make_trainer(path, lr=1e-2, micro_batch_tokens=16)
    trainer.train_step(make_batch(SHAPES), sft)
    names = [n for n, _ in trainer.named_weights()]
    assert len(names) == len(set(names))
    assert ("lm_head.weight" in names) != tied
    trainer.save(str(tmp_path / "ckpt"))

    def keys(directory: Path) -> set[str]:
        with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
            return set(f.keys())

    assert keys(tmp_path / "ckpt") == keys(Path(path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32)
    assert max_diff(dict(loaded.named_parameters()), weights(trainer)) == 0.0
    assert not math.isnan(trainer.train_step(make_batch(SHAPES), sft)["train/loss"])


# torch.compile of the layers: 50 s on a normal host, past the suite's 120 s default on a slow one.
@pytest.mark.timeout(600)
def test_compiled_layers_take_the_eager_step(model_path, make_trainer):
    # train.compile: "on" runs each decoder layer through torch.compile (Inductor); the
    # logprobs and the update must be the eager ones up to float rounding.
    batch = make_batch(SHAPES)
    results = []
    for mode in ("off", "on"):
        trainer = make_trainer(model_path, lr=1e-2, eps=1e-3, micro_batch_tokens=12, compile=mode)
        compiled = [layer for layer in trainer.model.model.layers if "forward" in layer.__dict__]
        assert len(compiled) == (len(trainer.model.model.layers) if mode == "on" else 0)
        logprobs = trainer.logprobs(batch).logprobs
        metrics = trainer.train_step(batch, sft)
        results.append((logprobs, metrics, weights(trainer)))
        trainer.close()
    (lp_eager, m_eager, w_eager), (lp_compiled, m_compiled, w_compiled) = results
    np.testing.assert_allclose(lp_compiled, lp_eager, rtol=0, atol=1e-5)
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert m_compiled[key] == pytest.approx(m_eager[key], rel=1e-5), key
    assert max_diff(w_compiled, w_eager) < 1e-5
    assert max_diff(w_eager, weights_before(model_path)) > 1e-4
