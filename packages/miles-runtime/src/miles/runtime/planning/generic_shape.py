"""A dense decoder's sizes from the config.json fields most architectures share (Llama, Mistral,
Qwen2...), for a model no installed family covers. The planner says when it used this: the
counts assume GQA attention without biases, a SwiGLU MLP and RMSNorms, and are estimates."""

from __future__ import annotations

from miles.core.contracts.family import Config, ModelShape, ParamCounts, text_config

_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
# Fields that mean the model is not a plain dense decoder (MoE, latent attention...).
_NOT_DENSE = ("num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank")


def generic_decoder_shape(config: Config) -> ModelShape | None:
    """The shape of a plain dense decoder, or None when the config is not one."""
    c = text_config(config)
    if any(c.get(k) is None for k in _REQUIRED) or any(c.get(k) for k in _NOT_DENSE):
        return None
    hidden, inter = int(c["hidden_size"]), int(c["intermediate_size"])
    layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    vocab = int(c["vocab_size"])
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * q + 2 * hidden * kv + q * hidden
    mlp = 3 * hidden * inter
    tied = bool(c.get("tie_word_embeddings", False))
    # Saved for backward per token and layer: norm inputs, q/k/v, attention output, the MLP's
    # input, gate, up, product and output.
    act = 2 * hidden + (hidden + q + 2 * kv + q + hidden) + (2 * hidden + 3 * inter)
    return ModelShape(
        params=ParamCounts(
            embedding=vocab * hidden,
            lm_head=0 if tied else vocab * hidden,
            layers=layers * (attention + mlp + 2 * hidden),
            other=hidden,
        ),
        num_layers=layers,
        hidden_size=hidden,
        vocab_size=vocab,
        active_expert_params=0,
        kv_elems_per_token=layers * 2 * kv,
        state_elems_per_seq=0,
        act_elems_per_token=layers * act,
    )
