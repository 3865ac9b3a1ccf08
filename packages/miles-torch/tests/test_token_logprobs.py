"""token_logprobs against a per-sequence reference, on a tiny fake causal LM (no FSDP, no HF).

The fake model's logits at a position depend only on the token there (an embedding and a head),
so each sequence run alone gives the reference logits, and right-padding cannot leak in.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from miles.core.contracts.types import PackedBatch, Sample
from miles.torch.train.logprobs import token_logprobs
from miles.torch.train.microbatch import make_micro_batch

VOCAB = 11


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, 6, generator=gen))
        self.head = torch.nn.Parameter(torch.randn(6, VOCAB, generator=gen) * 2)
        self.calls: list[dict[str, Any]] = []

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool
    ) -> SimpleNamespace:
        self.calls.append({"attention_mask": attention_mask, "use_cache": use_cache})
        return SimpleNamespace(logits=(self.embed[input_ids] @ self.head).to(torch.bfloat16))


SEQS = [[3, 1, 4, 1, 5], [9, 2], [6], [5, 3, 5]]  # lengths 5, 2, 1, 3: padding, a 1-token row


def _micro_batch() -> Any:
    samples = [Sample(prompt_ids=s[:1], response_ids=s[1:]) for s in SEQS]
    batch = PackedBatch.from_samples(samples)
    return make_micro_batch(batch, list(range(len(SEQS))), torch.device("cpu")), batch


def _reference(model: TinyLM, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat [tokens] logprobs and entropies, one sequence at a time, in float64."""
    logps, ents = [], []
    with torch.no_grad():
        for seq in SEQS:
            ids = torch.tensor(seq)
            logits = (model.embed[ids] @ model.head).to(torch.bfloat16).double() / temperature
            logp = torch.log_softmax(logits, dim=-1)
            logps += [0.0] + [float(logp[t - 1, seq[t]]) for t in range(1, len(seq))]
            ent = -(logp.exp() * logp).sum(-1)
            ents += [0.0] + [float(ent[t - 1]) for t in range(1, len(seq))]
    return torch.tensor(logps, dtype=torch.float64), torch.tensor(ents, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_and_entropy_match_each_sequence_alone(temperature: float) -> None:
    model = TinyLM()
    mb, batch = _micro_batch()
    logprobs, entropy = token_logprobs(model, mb, temperature)
    assert logprobs.dtype == torch.float32 and entropy.dtype == torch.float32
    assert logprobs.shape == entropy.shape == (len(batch.tokens),)
    want_logp, want_ent = _reference(model, temperature)
    torch.testing.assert_close(logprobs.double(), want_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), want_ent, rtol=0, atol=1e-5)
    first_tokens = torch.from_numpy(batch.offsets[:-1])
    assert bool((logprobs[first_tokens] == 0).all()) and bool((entropy[first_tokens] == 0).all())
    assert bool((logprobs[logprobs != 0] < 0).all()) and bool((entropy > -1e-6).all())
    # The model saw the padding mask, and no KV cache was asked for.
    (call,) = model.calls
    assert torch.equal(call["attention_mask"], mb.attention_mask) and call["use_cache"] is False


def test_outputs_carry_gradients_to_the_model() -> None:
    model = TinyLM()
    mb, _ = _micro_batch()
    logprobs, entropy = token_logprobs(model, mb, 1.0)
    (logprobs.sum() + entropy.sum()).backward()  # type: ignore[no-untyped-call]
    assert model.embed.grad is not None and bool(model.embed.grad.abs().sum() > 0)
    assert model.head.grad is not None and bool(model.head.grad.abs().sum() > 0)


def test_outputs_are_fp32_whatever_the_default_dtype() -> None:
    model = TinyLM()
    mb, _ = _micro_batch()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        logprobs, entropy = token_logprobs(model, mb, 1.0)
    finally:
        torch.set_default_dtype(before)
    assert logprobs.dtype == entropy.dtype == torch.float32


def test_a_micro_batch_of_one_token_sequences_predicts_nothing() -> None:
    model = TinyLM()
    samples = [Sample(prompt_ids=[4]), Sample(prompt_ids=[7])]
    mb = make_micro_batch(PackedBatch.from_samples(samples), [0, 1], torch.device("cpu"))
    logprobs, entropy = token_logprobs(model, mb, 1.0)
    assert logprobs.tolist() == [0.0, 0.0] and entropy.tolist() == [0.0, 0.0]
    assert np.array_equal(mb.token_index, [0, 1])
    assert logprobs.requires_grad and entropy.requires_grad  # backward still reaches the model


def _full_logits_reference(model: Any, mb: Any, temperature: float) -> tuple[Any, Any]:
    """The plain path: the micro-batch's whole logits, then fp32 log-softmax."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    logp = torch.log_softmax(logits[mb.rows, mb.cols].float() / temperature, dim=-1)
    targets = mb.input_ids[mb.rows, mb.cols + 1]
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_outputs_live_on_the_micro_batch_device() -> None:
    """(meta stands in for the GPU.)"""
    samples = [Sample(prompt_ids=s[:1], response_ids=s[1:]) for s in SEQS]
    mb = make_micro_batch(PackedBatch.from_samples(samples), [0, 1, 2, 3], torch.device("meta"))
    logprobs, entropy = token_logprobs(TinyLM().to("meta"), mb, 1.0)
    assert logprobs.device.type == entropy.device.type == "meta"
    assert logprobs.shape == entropy.shape == (mb.num_tokens,)


class HeadLM(torch.nn.Module):
    """A fake causal LM with an HF-style output layer (`get_output_embeddings`), optionally
    soft-capping or scaling its logits after the head, as Gemma, Cohere or Granite do. Records
    the shape of what its head returns."""

    def __init__(self, **config: float | None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 6)
        self.lm_head = torch.nn.Linear(6, VOCAB)
        self.config = SimpleNamespace(**config)
        self.head_shapes: list[tuple[int, ...]] = []

    def get_output_embeddings(self) -> torch.nn.Linear:
        return self.lm_head

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False
    ) -> SimpleNamespace:
        logits = self.lm_head(self.embed(input_ids) * 3)
        self.head_shapes.append(tuple(logits.shape))
        if cap := getattr(self.config, "final_logit_softcapping", None):
            logits = cap * torch.tanh(logits / cap)
        logits = logits * (getattr(self.config, "logit_scale", None) or 1.0)
        return SimpleNamespace(logits=logits / (getattr(self.config, "logits_scaling", None) or 1))


def _check_against_full_logits(model: HeadLM, temperature: float) -> Any:
    mb, _ = _micro_batch()
    logprobs, entropy = token_logprobs(model, mb, temperature)
    with torch.no_grad():
        want_lp, want_ent = _full_logits_reference(model, mb, temperature)
    zeros = torch.zeros(mb.num_tokens)
    torch.testing.assert_close(logprobs, zeros.index_put((mb.target_pos,), want_lp))
    torch.testing.assert_close(entropy, zeros.index_put((mb.target_pos,), want_ent))
    return mb


@pytest.mark.parametrize(
    "config", [{}, {"final_logit_softcapping": None, "logit_scale": 1.0, "logits_scaling": 1}]
)
def test_a_plain_linear_head_never_builds_the_full_vocabulary_logits(
    config: dict[str, float | None],
) -> None:
    """A linear head with nothing after it (no config, or soft-capping and scales that are
    off) yields each predicting token's (logprob, entropy) straight away: right values, and
    the head is itself again afterwards."""
    model = HeadLM(**config)
    mb = _check_against_full_logits(model, 0.8)
    assert model.head_shapes[0] == (len(mb.target_pos), 2)
    assert "forward" not in model.lm_head.__dict__
    assert model.lm_head(torch.zeros(6)).shape == (VOCAB,)


@pytest.mark.parametrize(
    "config", [{"final_logit_softcapping": 4.0}, {"logit_scale": 0.5}, {"logits_scaling": 3.0}]
)
def test_logits_changed_after_the_head_take_the_full_logits_path(
    config: dict[str, float | None],
) -> None:
    """Soft-capping or scaling after the head needs the real logits: the values are those of the
    model's own (capped or scaled) logits."""
    model = HeadLM(**config)
    mb = _check_against_full_logits(model, 0.8)
    assert model.head_shapes[0] == (*mb.input_ids.shape, VOCAB)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_the_full_logits_path_with_its_gradients(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, arch: str, temperature: float
) -> None:
    """Real transformers models: logprobs, entropies and the gradients of every parameter
    (the tied or untied head included) equal those of the full-logits path, with chunks of 7
    tokens so the chunk loop runs many times."""
    from transformers import AutoModelForCausalLM

    from miles.torch.train import chunked_head

    monkeypatch.setattr(chunked_head, "CHUNK_ELEMENTS", 7 * 128)
    model = AutoModelForCausalLM.from_pretrained(tiny_model(arch)).double().float()
    assert model.get_output_embeddings().weight.shape[0] == 128
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(3, 128, (n,), generator=g).tolist(),
            response_ids=torch.randint(3, 128, (m,), generator=g).tolist(),
        )
        for n, m in [(5, 9), (2, 17), (11, 1), (3, 6)]
    ]
    batch = PackedBatch.from_samples(samples)
    mb = make_micro_batch(batch, list(range(len(samples))), torch.device("cpu"))
    lp, ent = token_logprobs(model, mb, temperature)
    weights = torch.rand(len(lp), generator=g)
    (lp * weights).sum().add((ent * weights.flip(0)).sum()).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    want_lp, want_ent = _full_logits_reference(model, mb, temperature)
    flat = torch.zeros(mb.num_tokens).index_put((mb.target_pos,), want_lp)
    flat_ent = torch.zeros(mb.num_tokens).index_put((mb.target_pos,), want_ent)
    torch.testing.assert_close(lp, flat, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, flat_ent, rtol=0, atol=1e-5)
    (flat * weights).sum().add((flat_ent * weights.flip(0)).sum()).backward()
    theirs = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == theirs.keys()
    for name in ours:
        diff = float((ours[name] - theirs[name]).abs().max())
        assert diff <= 1e-6 + 1e-4 * float(theirs[name].abs().max()), (name, diff)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_head_kernels_equal_the_torch_path_on_gpu(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """On CUDA the chunk's softmax arithmetic runs in Triton (`head_kernel`): values and every
    gradient equal the torch path's (1e-4 relative in fp32), over several chunks and a
    vocabulary that is not a multiple of the kernel's block."""
    from miles.torch.train import chunked_head, head_kernel

    vocab, tokens, width = 9001, 300, 64
    monkeypatch.setattr(chunked_head, "CHUNK_ELEMENTS", 70 * vocab)  # 5 chunks
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden0 = torch.randn(tokens, width, device="cuda", generator=g).to(dtype)
    weight0 = (torch.randn(vocab, width, device="cuda", generator=g) * 0.3).to(dtype)
    bias0 = torch.randn(vocab, device="cuda", generator=g).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)
    w_lp, w_ent = torch.rand(tokens, device="cuda", generator=g), torch.rand(tokens, device="cuda")

    def run(fused: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(head_kernel, "available", lambda logits: fused)
        hidden, weight, bias = (t.clone().requires_grad_() for t in (hidden0, weight0, bias0))
        lp, ent = chunked_head.chunked_logprobs(hidden, weight, bias, targets, 0.7)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        return [lp, ent, hidden.grad, weight.grad, bias.grad]

    names = ["logprobs", "entropy", "grad hidden", "grad weight", "grad bias"]
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for name, ours, want in zip(names, run(True), run(False), strict=True):
        scale = float(want.float().abs().max())
        diff = float((ours.float() - want.float()).abs().max())
        assert diff <= tolerance * scale, (name, diff, scale)
