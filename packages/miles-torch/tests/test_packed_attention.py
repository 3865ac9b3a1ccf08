"""Packed micro-batches (one row, variable-length attention) against transformers' own padded
forward: the same logprobs, entropies and gradients, for every family that declares packing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.core.contracts.types import PackedBatch, Sample
from miles.torch.train import packed_attention
from miles.torch.train.checks import packs_sequences
from miles.torch.train.logprobs import token_logprobs
from miles.torch.train.microbatch import make_micro_batch

# Lengths 14, 19, 12, 9 and a one-token sequence: padding in the padded layout, a sequence
# with nothing to predict in both.
SHAPES = [(5, 9), (2, 17), (11, 1), (3, 6), (1, 0)]


def _batch(vocab: int = 128) -> PackedBatch:
    g = torch.Generator().manual_seed(0)
    return PackedBatch.from_samples(
        [
            Sample(
                prompt_ids=torch.randint(3, vocab, (n,), generator=g).tolist(),
                response_ids=torch.randint(3, vocab, (m,), generator=g).tolist(),
            )
            for n, m in SHAPES
        ]
    )


def _run(path: str, batch: PackedBatch, packed: bool) -> tuple[Any, Any, dict[str, Any]]:
    attn = packed_attention.NAME if packed else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
    mb = make_micro_batch(batch, list(range(len(batch))), torch.device("cpu"), packed=packed)
    lp, ent = token_logprobs(model, mb, 0.7)
    weights = torch.linspace(0.5, 1.5, len(lp))
    ((lp * weights).sum() + (ent * weights.flip(0)).sum()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("qwen3", {}),
        # A window shorter than the longer sequences: per-sequence banded masks.
        ("qwen3", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 0}),
        ("qwen3_moe", {}),
        ("deepseek_v3", {}),  # multi-latent attention: V narrower than Q/K
    ],
)
def test_packed_equals_padded_with_gradients(
    tiny_model: Callable[..., str], arch: str, overrides: dict[str, Any]
) -> None:
    path = tiny_model(arch, **overrides)
    batch = _batch()
    padded_lp, padded_ent, padded_grads = _run(path, batch, packed=False)
    packed_lp, packed_ent, packed_grads = _run(path, batch, packed=True)
    torch.testing.assert_close(packed_lp, padded_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed_ent, padded_ent, rtol=0, atol=1e-5)
    assert bool((packed_lp != 0).any())
    assert packed_grads.keys() == padded_grads.keys() and packed_grads
    for name, want in padded_grads.items():
        diff = float((packed_grads[name] - want).abs().max())
        assert diff <= 1e-6 + 1e-4 * float(want.abs().max()), (name, diff)


def test_packed_micro_batch_layout() -> None:
    batch = _batch()
    seqs = [1, 4, 3]
    mb = make_micro_batch(batch, seqs, torch.device("cpu"), packed=True)
    lens = [19, 1, 9]
    assert mb.input_ids.shape == (1, sum(lens)) and mb.attention_mask is None
    assert mb.cu_seq_lens is not None and mb.cu_seq_lens.tolist() == [0, 19, 20, 29]
    assert mb.cu_seq_lens.dtype == torch.int32 and mb.max_seq_len == 19
    assert mb.position_ids is not None
    assert mb.position_ids[0].tolist() == [*range(19), 0, *range(9)]
    want_tokens = np.concatenate(
        [batch.tokens[batch.offsets[s] : batch.offsets[s + 1]] for s in seqs]
    )
    assert mb.input_ids[0].tolist() == want_tokens.tolist()
    # Every token but each sequence's first is predicted, from the position before it.
    assert mb.target_pos.tolist() == [*range(1, 19), *range(21, 29)]
    assert mb.cols.tolist() == [t - 1 for t in mb.target_pos.tolist()]
    assert mb.seq_index.tolist() == [0] * 19 + [1] + [2] * 9


def test_the_packed_model_refuses_a_padded_call(tiny_model: Callable[..., str]) -> None:
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model("qwen3"), attn_implementation=packed_attention.NAME
    )
    with pytest.raises(ValueError, match="needs packed inputs"):
        model(input_ids=torch.tensor([[5, 6, 7]]))


def test_packing_follows_the_family(tiny_model: Callable[..., str], tmp_path: Any) -> None:
    qwen3 = tiny_model("qwen3")
    assert packs_sequences("auto", qwen3) and packs_sequences("on", qwen3)
    assert not packs_sequences("off", qwen3)
    # A model no family covers keeps padded micro-batches, and "on" says why it cannot pack.
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert not packs_sequences("auto", str(tmp_path))
    with pytest.raises(ValueError, match=r"train\.packing: 'on'.*use train\.packing: auto"):
        packs_sequences("on", str(tmp_path))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
def test_packed_flash_on_gpu_is_as_close_to_fp32_as_padded_bf16(
    tiny_model: Callable[..., str], monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """bf16 on CUDA goes through torch's varlen FlashAttention (counted); its logprobs are as
    close to the fp32 padded reference as transformers' own bf16 padded forward, and its
    gradients as close as that forward's."""
    flash_calls = []
    flash = packed_attention._flash
    monkeypatch.setattr(packed_attention, "_flash", lambda *a: flash_calls.append(1) or flash(*a))
    path = tiny_model(arch)
    batch = _batch()

    def run(packed: bool, dtype: torch.dtype) -> tuple[Any, dict[str, Any]]:
        attn = packed_attention.NAME if packed else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)
        model = model.to("cuda", dtype)
        mb = make_micro_batch(batch, list(range(len(batch))), torch.device("cuda"), packed=packed)
        lp, ent = token_logprobs(model, mb, 1.0)
        (lp.sum() + ent.sum()).backward()
        return lp.detach().double(), {
            n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None
        }

    want_lp, want_grads = run(False, torch.float32)
    padded_lp, padded_grads = run(False, torch.bfloat16)
    packed_lp, packed_grads = run(True, torch.bfloat16)
    assert flash_calls, "the bf16 packed forward did not use varlen FlashAttention"
    padded_err = float((padded_lp - want_lp).abs().max())
    packed_err = float((packed_lp - want_lp).abs().max())
    assert packed_err <= 2 * padded_err + 1e-3, (packed_err, padded_err)

    def grad_err(grads: dict[str, Any]) -> float:
        return max(float((grads[n] - g).norm() / (g.norm() + 1e-12)) for n, g in want_grads.items())

    assert grad_err(packed_grads) <= 2 * grad_err(padded_grads) + 1e-3
