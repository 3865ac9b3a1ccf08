"""HF <-> Megatron conversion as pure functions: complete, exact, and laid out as Megatron wants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from miles.core.contracts.family import MegatronMapping
from miles.megatron.convert import Index, TensorSource, gather, hf_names, shard
from miles.megatron.layout import ParallelLayout, Rank
from miles.megatron.sources import SafetensorsSource
from miles.recipes.families import deepseek_v3
from miles.recipes.families.qwen3 import (
    qwen3_megatron,
    qwen3_moe_megatron,
    qwen3_moe_tiny,
    qwen3_tiny,
)

CASES = {
    "qwen3": (qwen3_tiny, qwen3_megatron, {}),
    "qwen3_moe": (qwen3_moe_tiny, qwen3_moe_megatron, {"tie_word_embeddings": False}),
    # Multi-latent attention, a dense layer then MoE layers with shared experts and expert bias.
    "deepseek_v3": (deepseek_v3.tiny, deepseek_v3.megatron, {"num_hidden_layers": 4}),
    # A dense layer among MoE layers.
    "qwen3_moe_mixed": (
        qwen3_moe_tiny,
        qwen3_moe_megatron,
        {"mlp_only_layers": [0], "num_hidden_layers": 4},
    ),
}


def _model(case: str) -> tuple[dict[str, Any], MegatronMapping, dict[str, torch.Tensor]]:
    tiny, megatron, extra = CASES[case]
    config = {**tiny(), **extra, "vocab_size": 300}
    fields = {k: v for k, v in config.items() if k != "model_type"}
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if config.get("tie_word_embeddings"):
        del state["lm_head.weight"]  # the same tensor as the embeddings, saved once
    return config, megatron(config), state


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_mapping_reads_every_weight_transformers_has(case: str) -> None:
    _, mapping, state = _model(case)
    assert hf_names(mapping) == set(state)


LAYOUTS = [
    ParallelLayout(),
    ParallelLayout(tp=2),
    ParallelLayout(pp=2),
    ParallelLayout(tp=2, pp=2),
]
MOE_LAYOUTS = [
    ParallelLayout(ep=2),
    ParallelLayout(ep=4),
    ParallelLayout(tp=2, ep=2),
    ParallelLayout(tp=2, ep=2, etp=1),
    ParallelLayout(tp=2, pp=2, ep=4, etp=1),
]


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize(
    ("case", "layout"),
    [(c, lay) for c in sorted(CASES) for lay in LAYOUTS]
    + [(c, lay) for c in ("qwen3_moe", "qwen3_moe_mixed", "deepseek_v3") for lay in MOE_LAYOUTS],
)
def test_hf_to_shards_to_hf_is_exact(case: str, layout: ParallelLayout, spec: str) -> None:
    _, mapping, state = _model(case)
    shards = {r: shard(state, mapping, layout, r, spec) for r in layout.ranks()}  # type: ignore[arg-type]
    back = gather(shards, mapping, layout, spec)  # type: ignore[arg-type]
    assert set(back) == set(state)
    for name, tensor in state.items():
        assert torch.equal(back[name], tensor), name


def test_gather_takes_the_ranks_a_real_job_has() -> None:
    """In a Megatron job an expert's tensor rank is its process's tensor rank: no process holds
    (tp=0, etp=1). Gather reads each place from whichever rank has it."""
    _, mapping, state = _model("deepseek_v3")
    layout = ParallelLayout(tp=2, pp=2, ep=2)
    job = [Rank(pp=p, tp=t, ep=e, etp=t) for p in range(2) for t in range(2) for e in range(2)]
    back = gather({r: shard(state, mapping, layout, r) for r in job}, mapping, layout)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    with pytest.raises(KeyError, match="tensor-parallel index 1 of 2"):
        gather({r: shard(state, mapping, layout, r) for r in job if r.tp == 0}, mapping, layout)


def test_shards_are_cut_per_rank_then_fused() -> None:
    """Megatron's fused tensors hold each tensor rank's gate (or q/k/v) rows together."""
    config, mapping, state = _model("qwen3")
    layout = ParallelLayout(tp=2)
    rank1 = shard(state, mapping, layout, Rank(tp=1))
    gate, up = (state[f"model.layers.0.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    half = gate.shape[0] // 2
    assert torch.equal(
        rank1["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate[half:], up[half:]])
    )
    # One query group per rank (2 groups, 2 query heads each): q0 q1 k v of the second group.
    q, k, v = (state[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    d = config["head_dim"]
    assert torch.equal(
        rank1["decoder.layers.0.self_attention.linear_qkv.weight"],
        torch.cat([q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]]),
    )
    down = state["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(
        rank1["decoder.layers.1.mlp.linear_fc2.weight"], down[:, down.shape[1] // 2 :]
    )
    # The vocabulary (300) is padded to a multiple of 128 x tp (512): rank 1 holds rows 256..511,
    # the last 212 of them zeros.
    embed = rank1["embedding.word_embeddings.weight"]
    assert embed.shape[0] == 256
    assert torch.equal(embed[:44], state["model.embed_tokens.weight"][256:])
    assert not embed[44:].any()


def test_pipeline_stages_renumber_layers_and_experts_follow_their_rank() -> None:
    _, mapping, state = _model("qwen3_moe")
    layout = ParallelLayout(pp=2, ep=2)
    last = shard(state, mapping, layout, Rank(pp=1, ep=1))
    assert "embedding.word_embeddings.weight" not in last
    assert {"output_layer.weight", "decoder.final_layernorm.weight"} <= set(last)
    fc2 = last["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    # Stage 1's first layer is global layer 1; expert rank 1's first expert is global expert 2.
    assert torch.equal(fc2, state["model.layers.1.mlp.experts.down_proj"][2])


def test_te_names() -> None:
    _, mapping, state = _model("qwen3_moe_mixed")
    names = set(shard(state, mapping, ParallelLayout(), Rank(), "te"))
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names  # dense layer 0
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names  # MoE: the router reads it
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in names
    assert not any("input_layernorm" in n or "local_experts" in n for n in names)


def test_layouts_the_model_cannot_take_are_refused_clearly() -> None:
    _, mapping, state = _model("qwen3")
    with pytest.raises(ValueError, match="pipeline parallel size 3 does not divide"):
        shard(state, mapping, ParallelLayout(pp=3), Rank())
    with pytest.raises(ValueError, match="tensor parallel size 4 does not divide"):
        shard(state, mapping, ParallelLayout(tp=4), Rank())
    _, moe, moe_state = _model("qwen3_moe")
    with pytest.raises(ValueError, match="expert parallel size 3 does not divide"):
        shard(moe_state.__getitem__, moe, ParallelLayout(ep=3), Rank())


def test_what_megatron_cannot_express_is_listed() -> None:
    base = {**qwen3_tiny(), "vocab_size": 300}
    assert qwen3_megatron(base).unsupported == ()
    odd = {
        **base,
        "attention_bias": True,
        "use_sliding_window": True,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
    }
    listed = " ".join(qwen3_megatron(odd).unsupported)
    assert "attention_bias" in listed and "use_sliding_window" in listed and "yarn" in listed


class _Recording(TensorSource):
    """Counts the elements each read returns."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.elements = 0

    def read(self, name: str, index: Index) -> torch.Tensor:
        t = super().read(name, index)
        self.elements += t.numel()
        return t


def test_a_rank_reads_only_its_slices_from_safetensors(tmp_path: Path) -> None:
    _, mapping, state = _model("qwen3_moe")
    # Two files and an index, as transformers saves a sharded checkpoint.
    names = sorted(state)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: state[n].contiguous() for n in part}, tmp_path / f"m-{i}.safetensors")
    weight_map = {n: f"m-{int(n in names[half:])}.safetensors" for n in names}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    layout = ParallelLayout(tp=2, ep=2)
    for rank in layout.ranks():
        from_disk = shard(SafetensorsSource(tmp_path), mapping, layout, rank)
        recording = _Recording(state)
        from_memory = shard(recording, mapping, layout, rank)
        assert from_disk.keys() == from_memory.keys()
        assert all(torch.equal(from_disk[k], from_memory[k]) for k in from_disk)
        # What was read is what the rank holds (vocabulary padding aside): no whole tensors.
        held = sum(t.numel() for t in from_memory.values())
        assert recording.elements <= held < sum(t.numel() for t in state.values()) / 2


def test_a_missing_checkpoint_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        SafetensorsSource(tmp_path)


def test_what_megatron_cannot_express_in_deepseek_v3_is_listed() -> None:
    base = {**deepseek_v3.tiny(), "vocab_size": 300}
    assert deepseek_v3.megatron(base).unsupported == ()
    odd = {**base, "norm_topk_prob": False, "rope_parameters": {"rope_type": "llama3"}}
    listed = " ".join(deepseek_v3.megatron(odd).unsupported)
    assert "norm_topk_prob" in listed and "llama3" in listed


def test_kimi_k25_maps_its_language_model_as_deepseek_v3() -> None:
    from miles.core.contracts.family import text_config
    from miles.core.registry.families import family_named

    kimi = family_named("kimi_k25")
    config = kimi.tiny()  # type: ignore[misc]
    assert kimi.megatron is not None
    assert kimi.megatron(config) == deepseek_v3.megatron(text_config(config))
    assert kimi.megatron(config).transformer["multi_latent_attention"]
