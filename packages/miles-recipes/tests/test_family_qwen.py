"""The Qwen families (Qwen3, Qwen3-MoE, Qwen3.5/3.6 dense and MoE) against transformers: exact
parameter counts on the real configs and the tiny twins, the twins loading as the text causal LM
Miles trains (multimodal wrappers included) with every weight from the checkpoint, the MoE router
adapters and routing replay, and the notices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from miles.core.contracts.family import ModelFamily
from miles.recipes.architectures import config_for
from miles.recipes.families.qwen3 import qwen3, qwen3_moe
from miles.recipes.families.qwen3_5 import qwen3_5, qwen3_5_moe
from miles.recipes.twins import build_twin_model, twin_config_dict, write_twin
from miles.torch.routing import RoutingRecorder, RoutingReplay

FAMILIES = {f.name: f for f in (qwen3(), qwen3_moe(), qwen3_5(), qwen3_5_moe())}
MOE = ("qwen3_moe", "qwen3_5_moe")
AUTO_LM: Any = AutoModelForCausalLM  # untyped in transformers' stubs
CHECKPOINTS = [(name, ckpt) for name, fam in FAMILIES.items() for ckpt in fam.checkpoints]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _meta_counts(config: dict[str, Any]) -> tuple[int, int]:
    """(parameters of the checkpoint's architecture class, of the causal LM Miles loads), built
    on the meta device from the config dict."""
    fields = dict(config)
    architectures = fields.pop("architectures", None)
    with torch.device("meta"):
        cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
        model = (
            getattr(transformers, architectures[0])(cfg)
            if architectures
            else AUTO_LM.from_config(cfg)
        )
        causal = AUTO_LM.from_config(cfg)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in causal.parameters())


def _check_shape(family: ModelFamily, config: dict[str, Any]) -> None:
    assert family.shape is not None
    shape = family.shape(config)
    total, causal = _meta_counts(config)
    assert shape.params.total == total
    assert shape.params.language_model == causal
    assert shape.kv_elems_per_token > 0 or shape.state_elems_per_seq > 0
    assert shape.act_elems_per_token > 0


def test_checkpoint_lists_have_configs() -> None:
    assert {c for _, c in CHECKPOINTS} >= {
        "Qwen/Qwen3-0.6B",
        "Qwen/Qwen3-30B-A3B",
        "Qwen/Qwen3.5-27B",
        "Qwen/Qwen3.5-397B-A17B",
        "Qwen/Qwen3.5-35B-A3B",
        "Qwen/Qwen3.6-35B-A3B",
        "Qwen/Qwen3.6-27B",
    }
    for name, ckpt in CHECKPOINTS:
        config = config_for(ckpt)
        assert config is not None, ckpt
        types = {config["model_type"], config.get("text_config", {}).get("model_type")}
        assert types & set(FAMILIES[name].model_types), ckpt


@pytest.mark.parametrize(("name", "checkpoint"), CHECKPOINTS)
def test_shape_matches_transformers_on_real_configs(name: str, checkpoint: str) -> None:
    config = config_for(checkpoint)
    assert config is not None
    _check_shape(FAMILIES[name], config)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_shape_matches_transformers_on_tiny_configs(name: str) -> None:
    family = FAMILIES[name]
    config = twin_config_dict(family)
    _check_shape(family, config)
    if "text_config" in config:  # the text model alone, as Miles saves it after training
        text = {**config["text_config"]}
        assert text["model_type"] in family.model_types
        _check_shape(family, text)
        assert family.shape is not None and family.shape(text).params.vision == 0


def test_real_shapes_are_what_the_names_say() -> None:
    """Sanity against the model cards: total and active parameters."""
    billions = {}
    for name, ckpt in CHECKPOINTS:
        shape = FAMILIES[name].shape(config_for(ckpt))  # type: ignore[misc,arg-type]
        active = shape.params.language_model - shape.params.experts + shape.active_expert_params
        billions[ckpt] = (shape.params.total / 1e9, active / 1e9)
    assert round(billions["Qwen/Qwen3-30B-A3B"][1]) == 3
    assert round(billions["Qwen/Qwen3.5-397B-A17B"][0]) == 397
    assert round(billions["Qwen/Qwen3.5-397B-A17B"][1]) == 17
    assert round(billions["Qwen/Qwen3.5-35B-A3B"][0]) == 35
    assert round(billions["Qwen/Qwen3.5-27B"][0]) == 27


def test_linear_attention_layers_cache_no_tokens() -> None:
    config = config_for("Qwen/Qwen3.5-397B-A17B")
    assert config is not None
    shape = FAMILIES["qwen3_5_moe"].shape(config)  # type: ignore[misc]
    # 15 full-attention layers of 2 KV heads x 256; 45 Gated DeltaNet layers hold a fixed state
    assert shape.kv_elems_per_token == 15 * 2 * 2 * 256
    conv, recurrent = (2 * 16 * 128 + 64 * 128) * 3, 64 * 128 * 128
    assert shape.state_elems_per_seq == 45 * (conv + recurrent)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_sliding_window_layers_hold_a_window(name: str) -> None:
    config = {**FAMILIES[name].tiny(), "vocab_size": 28}  # type: ignore[misc]
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    fields = {k: v for k, v in config.items() if k != "model_type"}
    cfg = AutoConfig.for_model(config["model_type"], **fields)
    types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    sliding = sum(t == "sliding_attention" for t in types)
    per_layer = 2 * 2 * 16  # K and V, 2 KV heads of 16
    shape = FAMILIES[name].shape(config)  # type: ignore[misc]
    assert sliding > 0
    assert shape.kv_elems_per_token == (len(types) - sliding) * per_layer
    assert shape.state_elems_per_seq == sliding * 16 * per_layer


def test_quickstart_tiny_configs_are_pinned() -> None:
    base = {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 192,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "tie_word_embeddings": True,
        "initializer_range": 0.1,
    }
    moe = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    assert FAMILIES["qwen3"].tiny() == base  # type: ignore[misc]
    assert FAMILIES["qwen3_moe"].tiny() == {**base, **moe, "model_type": "qwen3_moe"}  # type: ignore[misc]


def _load(family: ModelFamily, path: str) -> Any:
    if family.load is not None:
        return family.load(path, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    torch.set_num_threads(1)
    return {
        name: write_twin(fam, tmp_path_factory.mktemp(name), seed=1)
        for name, fam in FAMILIES.items()
    }


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_twin_loads_every_weight_and_trains(name: str, twins: dict[str, str]) -> None:
    family, path = FAMILIES[name], twins[name]
    fields = twin_config_dict(family)
    if "architectures" in fields:  # the twin is the multimodal wrapper, as released
        assert (Path(path) / "config.json").read_text().count(fields["architectures"][0])
    model, info = AUTO_LM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert "ForCausalLM" in type(model).__name__
    # Every tensor is the checkpoint's (the wrapper keeps the text model one level down).
    written = build_twin_model(fields, seed=1).state_dict()
    for key, value in model.state_dict().items():
        source = (
            key.replace("model.", "model.language_model.", 1) if "text_config" in fields else key
        )
        torch.testing.assert_close(value, written[source], rtol=0, atol=0, msg=key)

    model = _load(family, path).train()
    tokens = _tokens(model.config.vocab_size)
    out = model(input_ids=tokens, labels=tokens)
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe"])
def test_trained_text_model_saves_and_reloads_by_its_own_type(
    name: str, twins: dict[str, str], tmp_path: Path
) -> None:
    model = _load(FAMILIES[name], twins[name])
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert again.config.model_type == f"{name}_text"
    assert again.config.model_type in FAMILIES[name].model_types
    for (key, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=key)


def _moe_layers(model: Any) -> int:
    return sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)


@pytest.mark.parametrize("name", MOE)
def test_router_adapter_reproduces_the_routers_weights(name: str, twins: dict[str, str]) -> None:
    family = FAMILIES[name]
    assert family.router is not None
    model = _load(family, twins[name])
    routers = family.router.routers(model)
    assert len(routers) == _moe_layers(model) == len(model.model.layers)
    outputs: list[tuple[torch.Tensor, ...]] = []
    for router in routers:
        router.register_forward_hook(lambda module, args, out: outputs.append((module, *out)))
    model(input_ids=_tokens(model.config.vocab_size))
    assert len(outputs) == len(routers)
    for router, logits, weights, indices in outputs:
        ours = family.router.gate_weights(router, logits, indices)
        torch.testing.assert_close(ours, weights)
        grad = torch.autograd.grad(ours.sum(), logits, retain_graph=True)[0]
        assert grad.abs().sum() > 0


@pytest.mark.parametrize("name", MOE)
def test_routing_replay(name: str, twins: dict[str, str]) -> None:
    family = FAMILIES[name]
    assert family.router is not None
    model = _load(family, twins[name]).eval()
    tokens = _tokens(model.config.vocab_size, seed=3)
    recorder = RoutingRecorder(model, family.router, with_weights=False)
    with torch.no_grad():
        live = model(input_ids=tokens).logits
    indices, _ = recorder.take()
    assert indices.shape[1] == _moe_layers(model)

    replay = RoutingReplay(model, family.router, "ids")
    with torch.no_grad(), replay.active(indices):
        replayed = model(input_ids=tokens).logits
    torch.testing.assert_close(replayed, live, atol=1e-5, rtol=0)
    other = (indices + 1) % model.config.num_experts
    with torch.no_grad(), replay.active(other):
        moved = model(input_ids=tokens).logits
    assert (moved - live).abs().max() > 1e-3

    model.zero_grad()
    with replay.active(other):
        model(input_ids=tokens).logits.float().logsumexp(-1).mean().backward()
    for router in family.router.routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def _messages(name: str, config: dict[str, Any]) -> list[tuple[str, bool]]:
    return [(n.message, n.fatal) for n in FAMILIES[name].notices(config)]


def test_notices_on_real_configs() -> None:
    assert _messages("qwen3", config_for("Qwen/Qwen3-0.6B")) == []  # type: ignore[arg-type]
    (aux,) = _messages("qwen3_moe", config_for("Qwen/Qwen3-30B-A3B"))  # type: ignore[arg-type]
    assert "load-balancing" in aux[0] and not aux[1]
    for name, ckpt in CHECKPOINTS:
        if not name.startswith("qwen3_5"):
            continue
        notes = _messages(name, config_for(ckpt))  # type: ignore[arg-type]
        assert not any(fatal for _, fatal in notes), ckpt
        text = " ".join(m for m, _ in notes)
        assert "MTP" in text and "multimodal" in text and "vision" in text
        assert ("load-balancing" in text) == (name == "qwen3_5_moe")


def test_fatal_notices() -> None:
    moe = config_for("Qwen/Qwen3.5-35B-A3B")
    assert moe is not None
    text = moe["text_config"]

    def fatal(name: str, config: dict[str, Any]) -> str:
        return " ".join(m for m, f in _messages(name, config) if f)

    base = config_for("Qwen/Qwen3-30B-A3B")
    assert base is not None
    # fp8 blocks load dequantized (said, not fatal); a format transformers cannot dequantize is.
    fp8 = {**base, "quantization_config": {"quant_method": "fp8"}}
    assert fatal("qwen3_moe", fp8) == ""
    assert any("dequantized" in m for m, _ in _messages("qwen3_moe", fp8))
    awq = {**base, "quantization_config": {"quant_method": "awq"}}
    assert "awq" in fatal("qwen3_moe", awq)
    assert (
        fatal(
            "qwen3_moe", {**awq, "quantization_config": {"quant_method": "awq", "dequantize": True}}
        )
        == ""
    )
    assert "attn_output_gate" in fatal(
        "qwen3_5_moe", {**moe, "text_config": {**text, "attn_output_gate": False}}
    )
    assert "norm_topk_prob" in fatal(
        "qwen3_5_moe", {**moe, "text_config": {**text, "norm_topk_prob": False}}
    )
    untied = {**moe, "tie_word_embeddings": True}
    assert "lm_head" in fatal("qwen3_5_moe", untied)
    assert (
        fatal("qwen3_5_moe", {**untied, "text_config": {**text, "tie_word_embeddings": True}}) == ""
    )


def test_parallel_hints() -> None:
    hints = FAMILIES["qwen3_5_moe"].parallel(config_for("Qwen/Qwen3.5-397B-A17B"))  # type: ignore[misc,arg-type]
    assert ("num_experts", 512) in hints.expert_divides
    assert hints.problems(tensor=2, expert=8, where="x") == []
    assert hints.problems(tensor=1, expert=3, where="x")
    dense = FAMILIES["qwen3"].parallel(config_for("Qwen/Qwen3-0.6B"))  # type: ignore[misc,arg-type]
    assert ("num_attention_heads", 16) in dense.tensor_divides and not dense.expert_divides
