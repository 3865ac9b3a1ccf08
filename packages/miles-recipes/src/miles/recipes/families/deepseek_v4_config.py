"""DeepSeek-V4's config.json as this family reads it: transformers' defaults under the file's
fields, and the per-layer schedules (attention kind, MoE routing kind, compression rates) that
DeepseekV4Config derives from them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.core.contracts.family import Config

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"

# DeepseekV4Config's legacy per-layer `compress_ratios` values (what the checkpoints ship).
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

# transformers' DeepseekV4Config defaults (documented there as DeepSeek-V4-Flash-Base) for the
# fields this family reads.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "num_experts_per_tok": 6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "compress_rates": {CSA: 4, HCA: 128},
    "hc_mult": 4,
    "num_hash_layers": 3,  # `default_num_hash_layers`; configs name it as the legacy kwarg
    "sliding_window": 128,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "mlp_bias": False,
    "router_aux_loss_coef": 0.001,
}


def config_fields(config: Config) -> dict[str, Any]:
    """config.json fields over transformers' defaults (a None field means "default" there)."""
    out = dict(DEFAULTS)
    out.update({k: v for k, v in config.items() if v is not None})
    if "num_local_experts" in config:  # DeepseekV4Config's attribute_map alias
        out["n_routed_experts"] = config["num_local_experts"]
    return out


def layer_types(c: Mapping[str, Any]) -> list[str]:
    """The attention kind of each layer, as DeepseekV4Config.__post_init__ derives it: explicit
    `layer_types`, else the legacy `compress_ratios`, else its V4-Pro-like default (two HCA
    layers, then HCA / CSA alternating); cut to `num_hidden_layers` (the checkpoints' lists have
    one more entry, for the MTP block)."""
    n = int(c["num_hidden_layers"])
    if c.get("layer_types") is not None:
        types = list(c["layer_types"])
    elif c.get("compress_ratios") is not None:
        unknown = [r for r in c["compress_ratios"] if int(r) not in _RATIO_TO_TYPE]
        if unknown:
            raise ValueError(f"compress_ratios values {unknown}: DeepSeek-V4 knows 0, 4 and 128")
        types = [_RATIO_TO_TYPE[int(r)] for r in c["compress_ratios"]]
    else:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return types[:n]


def mlp_layer_types(c: Mapping[str, Any]) -> list[str]:
    """ "hash_moe" (routed by the token-id table) or "moe" (top-k routed) per layer."""
    n = int(c["num_hidden_layers"])
    if c.get("mlp_layer_types") is not None:
        return list(c["mlp_layer_types"])[:n]
    hashed = min(n, int(c["num_hash_layers"]))
    return [HASH_MOE] * hashed + ["moe"] * (n - hashed)


def compress_rates(c: Mapping[str, Any]) -> dict[str, int]:
    """Tokens pooled into one compressed entry, per compressed layer kind."""
    rates = {**DEFAULTS["compress_rates"], **(c.get("compress_rates") or {})}
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        if c.get(legacy) is not None:
            rates[kind] = int(c[legacy])
    return {kind: int(rate) for kind, rate in rates.items()}
