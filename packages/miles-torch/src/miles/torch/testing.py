"""Tiny random Hugging Face checkpoints for tests and benchmarks (no hub access needed).

`make_tiny_model` writes a directory that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load like any real checkpoint: config.json, model.safetensors,
generation_config.json and a character-level tokenizer with a Qwen-style chat template.

The tokenizer maps every printable ASCII character (and newline) to one token, so any token id
decodes to at least one character and text round-trips exactly. Ids past the characters (up to
`vocab_size`) are multi-letter filler tokens, so every id the model can emit is decodable.
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = SPECIAL_TOKENS
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def _vocab(vocab_size: int) -> dict[str, int]:
    tokens = list(SPECIAL_TOKENS) + _CHARS
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size must be at least {len(tokens)}, got {vocab_size}")
    fillers = (
        "".join(p)
        for n in itertools.count(2)
        for p in itertools.product(string.ascii_lowercase, repeat=n)
    )
    tokens += list(itertools.islice(fillers, vocab_size - len(tokens)))
    return {tok: i for i, tok in enumerate(tokens)}


def make_tokenizer(vocab_size: int) -> Any:
    """A character-level `PreTrainedTokenizerFast` with exactly `vocab_size` ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=_vocab(vocab_size), unk_token=PAD_TOKEN))
    # One pre-token per character; Fuse joins decoded tokens without separators.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A few-layer config for `arch` ("qwen3", "qwen3_moe" or "deepseek_v3"); `overrides`
    replace any field."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    ids = _vocab(vocab_size)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        # Larger than the usual 0.02 so random logits are peaked enough for argmax to be stable.
        initializer_range=0.1,
        tie_word_embeddings=False,
        pad_token_id=ids[PAD_TOKEN],
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
    )
    if arch == "qwen3":
        return Qwen3Config(**{**common, "intermediate_size": 128, **overrides})
    if arch == "qwen3_moe":
        moe = dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            norm_topk_prob=True,
        )
        return Qwen3MoeConfig(**{**common, **moe, **overrides})
    if arch == "deepseek_v3":
        from transformers import DeepseekV3Config

        deepseek = dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE: adapters must skip dense
            num_hidden_layers=3,
            num_key_value_heads=4,  # MLA: one key per query head (as the real model)
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            head_dim=8,  # the rotary part of each head (DeepSeek ropes only qk_rope_head_dim)
            qk_nope_head_dim=8,
            v_head_dim=16,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
        )
        return DeepseekV3Config(**{**common, **deepseek, **overrides})
    raise ValueError(f"unknown arch {arch!r}; expected 'qwen3', 'qwen3_moe' or 'deepseek_v3'")


def make_tiny_model(
    path: str | Path, arch: str = "qwen3", vocab_size: int = 128, seed: int = 0, **overrides: Any
) -> str:
    """Write a random-weight checkpoint (fp32 safetensors + tokenizer) to `path`; return the path.

    Equal arguments give bitwise-equal weights. Extra keyword arguments override config fields
    (e.g. `num_hidden_layers=4`).
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab_size, **overrides)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.bos_token_id = config.bos_token_id
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    make_tokenizer(vocab_size).save_pretrained(path)
    return str(path)


def make_trainer(
    model_path: str,
    *,
    master_port: int,
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    **options: Any,
) -> Any:
    """An `FSDPTrainer` for tests and benchmarks: `options` are FSDPConfig fields and
    TrainSetup fields alike (reference=True, critic=True, lora=LoRAConfig(...), ...); the
    precision defaults to fp32."""
    import dataclasses

    from miles.core.contracts.backends import TrainSetup
    from miles.precision.dtype import fp32
    from miles.torch.train.config import FSDPConfig
    from miles.torch.train.fsdp import FSDPTrainer

    setup_fields = {f.name for f in dataclasses.fields(TrainSetup)}
    setup = TrainSetup(
        model_path=model_path,
        rank=rank,
        world_size=world_size,
        master_addr="127.0.0.1",
        master_port=master_port,
        device=device,
        seed=options.pop("seed", 0),
        precision=options.pop("precision", None) or fp32(),
        **{k: options.pop(k) for k in list(options) if k in setup_fields},
    )
    return FSDPTrainer(FSDPConfig(**options), setup)


def sync_in_place(trainer: Any, engine: Any, bucket_bytes: int = 1 << 20) -> None:
    """Colocated-style weight sync on CPU (the engine loads each bucket the trainer fills), then
    the engine's next weight version: what a run's sync does, without Ray."""
    plan = trainer.weight_sync_plan(bucket_bytes)
    trainer.send_weights_in_place(plan, lambda i, h: engine.load_bucket(plan, i, h))
    engine.set_weight_version(engine.weight_version + 1)
