"""The torch engine and the FSDP trainer across attention and cache architectures.

Tiny random models of each architecture, with every feature that changes the cache present:
Qwen3.5's Gated DeltaNet linear-attention layers next to full attention, GLM-MoE-DSA's MLA with a
DSA indexer whose top-k is smaller than the sequences, DeepSeek-V4's sliding window and both
compressed (CSA, HCA) caches with hash-routed and learned MoE layers. For each, every logprob the
engine returns must be transformers' own plain forward over the unpadded sequence, greedy output
must be `generate()`'s, and the trainer's per-token logprobs must be that forward's too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM

from miles.core.contracts.types import (
    GenerateRequest,
    GenerateResult,
    PackedBatch,
    Sample,
    SamplingParams,
)
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.testing import make_tokenizer, tiny_config

torch.set_num_threads(1)

VOCAB = 128
# Repeated lengths give DeepSeek-V4 (which batches only equal lengths) batches of several rows;
# the 30-token prompt outgrows its sliding window and several compression windows.
PROMPT_LENS = [5, 17, 9, 2, 30, 11, 1, 23, 9, 17, 9]
BUDGETS = [12, 3, 8, 1, 10, 5, 12, 7, 6, 12, 2]  # rows finish at different steps
MAX_BATCH = 3  # fewer than the requests: rows finish, are compacted, new prompts join
ATOL = 1e-4
# How the engine batches each architecture (see `miles.torch.engine.batch.batching_mode`).
MODES = {
    "qwen3": "padded",
    "deepseek_v3": "padded",
    "qwen3_5": "padded",
    "qwen3_5_moe": "padded",
    "glm_moe_dsa": "padded",
    "deepseek_v4": "unpadded",
}
ARCHS = list(MODES)


def arch_config(arch: str):
    """A 2-4 layer config of `arch` with every cache-relevant feature switched on."""
    from transformers import (
        DeepseekV4Config,
        GlmMoeDsaConfig,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    # The fields every tiny model shares (vocab, width, token ids), as miles.torch.testing sets them.
    base = tiny_config("qwen3", VOCAB).to_dict()
    shared = ["vocab_size", "hidden_size", "num_attention_heads", "initializer_range"]
    shared += ["tie_word_embeddings", "pad_token_id", "bos_token_id", "eos_token_id"]
    common = {k: base[k] for k in shared} | {"max_position_embeddings": 512}
    if arch == "qwen3":
        return tiny_config("qwen3", VOCAB)
    if arch == "deepseek_v3":
        # MLA needs as many KV heads as query heads: transformers' padded-mask attention path
        # repeats K/V by heads // kv_heads and fails otherwise.
        return tiny_config("deepseek_v3", VOCAB, num_key_value_heads=4)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        hybrid = dict(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            num_key_value_heads=2,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        if arch == "qwen3_5":
            return Qwen3_5TextConfig(**common, **hybrid, intermediate_size=128)
        return Qwen3_5MoeTextConfig(
            **common,
            **hybrid,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        )
    if arch == "glm_moe_dsa":
        return GlmMoeDsaConfig(
            **common,
            num_hidden_layers=3,
            num_key_value_heads=4,
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            index_topk=4,  # fewer than most sequences: sparsity matters
            index_head_dim=16,
            # Many indexer heads: with few, ReLU scores often tie at exactly 0 and transformers'
            # top-k then breaks ties differently for different lengths (even without a cache).
            index_n_heads=16,
            indexer_types=["full", "shared", "full"],
        )
    if arch == "deepseek_v4":
        return DeepseekV4Config(
            **common,
            num_hidden_layers=3,
            num_key_value_heads=1,
            head_dim=16,
            partial_rotary_factor=0.5,
            q_lora_rank=32,
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            layer_types=[
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            mlp_layer_types=["hash_moe", "moe", "moe"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
            sliding_window=8,
            o_groups=2,
            o_lora_rank=16,
            index_n_heads=16,  # see GLM above
            index_head_dim=16,
            index_topk=2,
            hc_mult=2,
            hc_sinkhorn_iters=3,
        )
    raise ValueError(arch)


def write_model(path: str, arch: str, seed: int = 0) -> str:
    config = arch_config(arch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            # A zero pad embedding (the init's) makes every indexer score of a generated pad
            # token tie at 0; real checkpoints have none.
            model.get_input_embeddings().weight[config.pad_token_id].normal_(0, 0.1)
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith("tid2eid"):  # hash routing: a random token -> experts table
                    tensor.copy_(torch.randint_like(tensor, config.n_routed_experts))
                elif name.endswith(("position_bias", "sinks")):  # zero at init
                    tensor.normal_(0, 0.5)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.save_pretrained(path)
    make_tokenizer(VOCAB).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def arch_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    @functools.cache
    def make(arch: str) -> str:
        return write_model(str(tmp_path_factory.mktemp(arch)), arch)

    return make


@functools.cache
def reference_model(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def plain_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax (T = 1) of one unpadded, uncached forward: row t predicts token t + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def make_requests(temperature: float) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(0)
    return [
        GenerateRequest(
            i,
            torch.randint(3, VOCAB, (n,), generator=g).tolist(),
            SamplingParams(temperature=temperature, max_new_tokens=budget),
        )
        for i, (n, budget) in enumerate(zip(PROMPT_LENS, BUDGETS, strict=True))
    ]


def test_configs_exercise_every_feature():
    qwen = arch_config("qwen3_5")
    assert set(qwen.layer_types) == {"linear_attention", "full_attention"}
    glm = arch_config("glm_moe_dsa")
    assert glm.index_topk < max(PROMPT_LENS) and set(glm.indexer_types) == {"full", "shared"}
    v4 = arch_config("deepseek_v4")
    assert set(v4.layer_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert set(v4.mlp_layer_types) == {"hash_moe", "moe"}
    rates = v4.compress_rates.values()
    assert v4.sliding_window < max(PROMPT_LENS) and max(rates) < max(PROMPT_LENS)


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_matches_transformers(arch_model, arch):
    path = arch_model(arch)
    with capture_logs() as logs:
        engine = TorchRolloutEngine(path, max_batch_size=MAX_BATCH, seed=1)
    modes = [e for e in logs if e["event"] == "torch engine batching"]
    assert [e["mode"] for e in modes] == [MODES[arch]] and modes[0]["reason"]
    model = reference_model(path)

    for temperature in (0.0, 1.0):
        requests = make_requests(temperature)
        results: dict[int, GenerateResult] = {r.request_id: r for r in engine.results(requests)}
        assert sorted(results) == [r.request_id for r in requests]
        for req in requests:
            res = results[req.request_id]
            assert len(res.response_ids) == len(res.logprobs) > 0
            if res.finish_reason == "length":
                assert len(res.response_ids) == req.sampling.max_new_tokens
            ref = plain_logprobs(model, req.prompt_ids + res.response_ids)
            ref = ref[len(req.prompt_ids) - 1 : -1]
            chosen = ref.gather(1, torch.tensor(res.response_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(res.logprobs), chosen, rtol=0, atol=ATOL)
            if temperature == 0:
                with torch.no_grad():
                    out = model.generate(
                        torch.tensor([req.prompt_ids]),
                        max_new_tokens=req.sampling.max_new_tokens,
                        do_sample=False,
                    )
                generated = out[0, len(req.prompt_ids) :].tolist()
                assert res.response_ids == generated[: len(res.response_ids)], req.request_id


def packed_batch(seed: int = 0) -> PackedBatch:
    rng = np.random.default_rng(seed)
    shapes = [(3, 6), (8, 1), (1, 0), (5, 20), (4, 4), (2, 9), (30, 12)]
    samples = [
        Sample(
            prompt_ids=rng.integers(3, VOCAB, p).tolist(),
            response_ids=rng.integers(3, VOCAB, r).tolist(),
            sample_id=i,
        )
        for i, (p, r) in enumerate(shapes)
    ]
    return PackedBatch.from_samples(samples, advantages=[1.0] * len(samples))


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_logprobs_match_transformers(arch_model, make_trainer, arch):
    path = arch_model(arch)
    # A 48-token budget: several right-padded sequences share a micro-batch.
    trainer = make_trainer(path, micro_batch_tokens=48)
    batch = packed_batch()
    out = trainer.logprobs(batch).logprobs
    model = reference_model(path)
    for i in range(len(batch)):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        tokens = batch.tokens[lo:hi].tolist()
        want = plain_logprobs(model, tokens)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])
        np.testing.assert_allclose(out[lo + 1 : hi], want[:, 0].numpy(), rtol=0, atol=ATOL)
        assert out[lo] == 0.0
