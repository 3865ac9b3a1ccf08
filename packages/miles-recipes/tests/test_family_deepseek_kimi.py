"""The DeepSeek-V3 (and Kimi K2) and Kimi K2.5/K2.6 families against transformers: exact parameter
counts on the real configs and the tiny twins; the twins loading as the DeepSeek-V3 causal LM Miles
trains (the Kimi K2.5 multimodal wrapper included, from its released weight layout too) with every
weight from the checkpoint; Kimi K2 configs and fp8 checkpoints loading; the router adapters and
routing replay; the notices."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from miles.core.contracts.family import ModelFamily
from miles.recipes.architectures import config_for
from miles.recipes.families import deepseek_v3 as ds
from miles.recipes.families import kimi_k25 as kk
from miles.recipes.twins import build_twin_model, twin_config_dict, write_twin
from miles.torch.models import load_causal_lm
from miles.torch.routing import RoutingRecorder, RoutingReplay

FAMILIES = {"deepseek_v3": ds.deepseek_v3(), "kimi_k25": kk.kimi_k25()}
CHECKPOINTS = [(name, ckpt) for name, fam in FAMILIES.items() for ckpt in fam.checkpoints]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def _config(fields: dict[str, Any]) -> Any:
    fields = copy.deepcopy(fields)  # Kimi_K25Config rewrites its text_config dict in place
    fields.pop("architectures", None)
    model_type = fields.pop("model_type")
    # Kimi K2's model_type is known to transformers only through remote code; `load` reads it
    # as DeepSeek-V3.
    return AutoConfig.for_model("deepseek_v3" if model_type == "kimi_k2" else model_type, **fields)


def _meta_counts(config: dict[str, Any]) -> tuple[int, int]:
    """(parameters of the checkpoint's architecture class, of the causal LM Miles loads), built
    on the meta device from the config dict."""
    cfg = _config(config)
    with torch.device("meta"):
        if cfg.model_type == "kimi_k25":
            model = transformers.Kimi_K25ForConditionalGeneration(cfg)
            causal = AutoModelForCausalLM.from_config(kk.causal_lm_config(cfg))
        else:
            model = causal = AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in causal.parameters())


def _check_shape(family: ModelFamily, config: dict[str, Any]) -> None:
    assert family.shape is not None
    shape = family.shape(config)
    total, causal = _meta_counts(config)
    assert shape.params.total == total
    assert shape.params.language_model == causal
    assert shape.kv_elems_per_token > 0 and shape.act_elems_per_token > 0


def test_checkpoint_lists_have_configs() -> None:
    assert {c for _, c in CHECKPOINTS} == {
        "deepseek-ai/DeepSeek-V3",
        "moonshotai/Kimi-K2.5",
        "moonshotai/Kimi-K2.6",
    }
    for name, ckpt in CHECKPOINTS:
        config = config_for(ckpt)
        assert config is not None, ckpt
        assert config["model_type"] in FAMILIES[name].model_types, ckpt


@pytest.mark.parametrize(("name", "checkpoint"), CHECKPOINTS)
def test_shape_matches_transformers_on_real_configs(name: str, checkpoint: str) -> None:
    config = config_for(checkpoint)
    assert config is not None
    _check_shape(FAMILIES[name], config)


def test_shape_matches_transformers_on_a_kimi_k2_config() -> None:
    """Kimi K2 (text only, model_type kimi_k2): the language model of the K2.5 release."""
    config = config_for("moonshotai/Kimi-K2.5")
    assert config is not None and config["text_config"]["model_type"] == "kimi_k2"
    _check_shape(FAMILIES["deepseek_v3"], config["text_config"])


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_shape_matches_transformers_on_tiny_configs(name: str) -> None:
    family = FAMILIES[name]
    config = twin_config_dict(family)
    _check_shape(family, config)
    assert family.tiny is not None
    _check_shape(family, family.tiny())  # transformers' default vocabulary
    if name == "kimi_k25":  # the text model alone is a Kimi K2 / DeepSeek-V3 config
        text = {**config["text_config"], "tie_word_embeddings": config["tie_word_embeddings"]}
        _check_shape(FAMILIES["deepseek_v3"], text)
        assert family.shape is not None and family.shape(config).params.vision > 0


def test_real_shapes_are_what_the_model_cards_say() -> None:
    billions = {}
    for name, ckpt in CHECKPOINTS:
        shape = FAMILIES[name].shape(config_for(ckpt))  # type: ignore[misc,arg-type]
        active = shape.params.language_model - shape.params.experts + shape.active_expert_params
        billions[ckpt] = (round(shape.params.total / 1e9), round(active / 1e9))
    # DeepSeek-V3: 671B total, 37B active (its MTP module's 14B are not built by transformers).
    assert billions["deepseek-ai/DeepSeek-V3"] == (671, 38)
    # Kimi K2.5 / K2.6: 1T total, 32B active, a vision encoder of about 0.4B plus its projector.
    assert billions["moonshotai/Kimi-K2.5"] == billions["moonshotai/Kimi-K2.6"] == (1027, 33)
    vision = FAMILIES["kimi_k25"].shape(config_for("moonshotai/Kimi-K2.5")).params.vision  # type: ignore[misc,arg-type]
    assert 0.4e9 < vision < 0.5e9


def test_mla_caches_the_latent_and_the_rotary_key() -> None:
    shape = FAMILIES["deepseek_v3"].shape(config_for("deepseek-ai/DeepSeek-V3"))  # type: ignore[misc,arg-type]
    assert shape.kv_elems_per_token == 61 * (512 + 64)
    assert shape.state_elems_per_seq == 0


def test_sizing_is_torch_free() -> None:
    code = (
        "import sys\n"
        "from miles.recipes.architectures import config_for\n"
        "from miles.recipes.families import deepseek_v3 as ds, kimi_k25 as kk\n"
        "for fam, ckpt in ((ds, 'deepseek-ai/DeepSeek-V3'), (kk, 'moonshotai/Kimi-K2.5')):\n"
        "    c = config_for(ckpt); fam.shape(c); fam.parallel(c); fam.notices(c)\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_parallel_hints() -> None:
    kimi = FAMILIES["kimi_k25"].parallel(config_for("moonshotai/Kimi-K2.5"))  # type: ignore[misc,arg-type]
    assert not kimi.problems(tensor=8, expert=128, where="x")
    assert len(kimi.problems(tensor=128, expert=256, where="x")) == 2  # 64 heads, 384 experts
    deepseek = FAMILIES["deepseek_v3"].parallel(config_for("deepseek-ai/DeepSeek-V3"))  # type: ignore[misc,arg-type]
    assert not deepseek.problems(tensor=16, expert=256, where="x")


# --- the twins -------------------------------------------------------------------------------


def _load(name: str, path: str) -> Any:
    """As Miles loads it: through `load_causal_lm`, which finds the family by model_type."""
    assert FAMILIES[name].load is not None
    return load_causal_lm(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    torch.set_num_threads(1)
    return {
        name: write_twin(fam, tmp_path_factory.mktemp(name), seed=1)
        for name, fam in FAMILIES.items()
    }


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(seed))


def _written(name: str) -> dict[str, torch.Tensor]:
    """The twin's weights under the causal LM's names (the wrapper keeps the text model one
    level down)."""
    state = build_twin_model(twin_config_dict(FAMILIES[name]), seed=1).state_dict()
    if name == "kimi_k25":
        prefix = "model.language_model."
        state = {
            key.replace(prefix, "model.", 1): value
            for key, value in state.items()
            if key.startswith(prefix) or key == "lm_head.weight"
        }
    return state


def _assert_same_weights(model: Any, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(state) == set(expected)
    for key, value in state.items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_twin_loads_every_weight_and_trains(name: str, twins: dict[str, str]) -> None:
    model = _load(name, twins[name]).train()
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    _assert_same_weights(model, _written(name))
    tokens = _tokens(model.config.vocab_size)
    out = model(input_ids=tokens, labels=tokens)
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    assert not [n for n, p in model.named_parameters() if p.grad is None]
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_kimi_twin_is_the_wrapper_and_loads_as_its_language_model(twins: dict[str, str]) -> None:
    path = twins["kimi_k25"]
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["architectures"] == ["Kimi_K25ForConditionalGeneration"]
    with pytest.raises(ValueError):  # no causal-LM mapping for kimi_k25
        AutoModelForCausalLM.from_pretrained(path)
    wrapper = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).eval()
    model = _load("kimi_k25", path).eval()
    tokens = _tokens(model.config.vocab_size, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, wrapper(input_ids=tokens).logits)
    # The routers are found through the wrapper as well as in the causal LM.
    router = FAMILIES["kimi_k25"].router
    assert router is not None and len(router.routers(wrapper)) == len(router.routers(model)) == 2


def test_kimi_load_reads_the_released_weight_layout(twins: dict[str, str], tmp_path: Path) -> None:
    """The release names the language model `language_model.model.layers.*`; transformers 5.x
    saves the wrapper's as `language_model.model.blocks.*`. Both load."""
    twin = Path(twins["kimi_k25"])
    weights = load_file(twin / "model.safetensors")
    assert any(k.startswith("language_model.model.blocks.") for k in weights)
    released = {
        k.replace("language_model.model.blocks.", "language_model.model.layers.", 1): v
        for k, v in weights.items()
    }
    save_file(released, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((twin / "config.json").read_text())
    _assert_same_weights(_load("kimi_k25", str(tmp_path)), _written("kimi_k25"))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_trained_model_saves_and_reloads_as_deepseek_v3(
    name: str, twins: dict[str, str], tmp_path: Path
) -> None:
    model = _load(name, twins[name])
    model.save_pretrained(tmp_path)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert again.config.model_type in FAMILIES["deepseek_v3"].model_types
    _assert_same_weights(again, model.state_dict())


def test_kimi_k2_config_loads_through_the_family(twins: dict[str, str], tmp_path: Path) -> None:
    """A Kimi K2 config.json says model_type kimi_k2 with remote-code pointers."""
    twin = Path(twins["deepseek_v3"])
    config = json.loads((twin / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((twin / "model.safetensors").read_bytes())
    with pytest.raises(ValueError):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    _assert_same_weights(_load("deepseek_v3", str(tmp_path)), _written("deepseek_v3"))


def test_fp8_checkpoint_loads_dequantized(twins: dict[str, str], tmp_path: Path) -> None:
    """DeepSeek-V3's layout: fp8 e4m3 Linear weights with `weight_scale_inv` block scales."""
    twin = Path(twins["deepseek_v3"])
    quantized = {}
    for key, value in load_file(twin / "model.safetensors").items():
        if key.endswith("_proj.weight") and value.ndim == 2:  # one 128x128 block: one scale
            scale = value.abs().amax() / 448.0
            quantized[key] = (value / scale).to(torch.float8_e4m3fn)
            quantized[key.replace(".weight", ".weight_scale_inv")] = scale.reshape(1, 1)
        else:
            quantized[key] = value
    save_file(quantized, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((twin / "config.json").read_text())
    config["quantization_config"] = config_for("deepseek-ai/DeepSeek-V3")["quantization_config"]  # type: ignore[index]
    (tmp_path / "config.json").write_text(json.dumps(config))

    notes = FAMILIES["deepseek_v3"].notices(config)
    assert any("fp8" in n.message and not n.fatal for n in notes)
    model = _load("deepseek_v3", str(tmp_path))
    assert getattr(model.config, "quantization_config", None) is None
    expected = _written("deepseek_v3")
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32, key
        # e4m3 keeps 3 mantissa bits: within 1/16 of the block's largest magnitude
        bound = expected[key].abs().max() / 16 + 1e-6
        assert (value - expected[key]).abs().max() <= bound, key


# --- routers ---------------------------------------------------------------------------------


def _moe_layers(model: Any) -> int:
    return sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_router_adapter_reproduces_the_routers_weights(name: str, twins: dict[str, str]) -> None:
    model = _load(name, twins[name])
    adapter = FAMILIES[name].router
    assert adapter is not None
    routers = adapter.routers(model)
    assert len(routers) == _moe_layers(model) == len(model.model.layers) - 1  # layer 0 is dense
    for router in routers:
        hidden = torch.randn(
            10, model.config.hidden_size, generator=torch.Generator().manual_seed(0)
        )
        logits, weights, indices = router(hidden)
        gates = adapter.gate_weights(router, logits, indices)
        torch.testing.assert_close(gates, weights)
        gates.sum().backward()  # through the logits, to the router's weight
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_routing_replay(name: str, twins: dict[str, str]) -> None:
    adapter = FAMILIES[name].router
    assert adapter is not None
    model = _load(name, twins[name]).eval()
    tokens = _tokens(model.config.vocab_size, seed=2)
    recorder = RoutingRecorder(model, adapter, with_weights=False)
    with torch.no_grad():
        live = model(input_ids=tokens).logits
    recorded, _ = recorder.take()
    assert recorded.shape[1] == _moe_layers(model)

    model = _load(name, twins[name]).eval()
    replay = RoutingReplay(model, adapter, "ids")
    with torch.no_grad(), replay.active(recorded):
        torch.testing.assert_close(model(input_ids=tokens).logits, live, atol=1e-5, rtol=0)
    experts = model.config.n_routed_experts
    other = (recorded + 1) % experts
    with replay.active(other):
        logits = model(input_ids=tokens).logits
        assert not torch.allclose(logits, live, atol=1e-4)
        logits.logsumexp(-1).mean().backward()
    for router in adapter.routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# --- notices ---------------------------------------------------------------------------------


def _messages(name: str, config: dict[str, Any]) -> list[tuple[bool, str]]:
    return [(n.fatal, n.message) for n in FAMILIES[name].notices(config)]


def test_deepseek_v3_notices() -> None:
    config = config_for("deepseek-ai/DeepSeek-V3")
    assert config is not None
    notes = _messages("deepseek_v3", config)
    assert not [m for fatal, m in notes if fatal]
    assert any("MTP" in m and "num_nextn_predict_layers=1" in m for _, m in notes)
    assert any("fp8" in m for _, m in notes)
    assert any("e_score_correction_bias" in m for _, m in notes)


@pytest.mark.parametrize("checkpoint", ["moonshotai/Kimi-K2.5", "moonshotai/Kimi-K2.6"])
def test_kimi_int4_checkpoints_need_compressed_tensors(
    checkpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = config_for(checkpoint)
    assert config is not None
    monkeypatch.setattr(ds, "installed", lambda package: False)
    notes = _messages("kimi_k25", config)
    fatal = [m for is_fatal, m in notes if is_fatal]
    assert len(fatal) == 1 and "compressed-tensors" in fatal[0] and "4-bit int" in fatal[0]
    assert any("vision tower" in m for _, m in notes)
    assert not any("MTP" in m for _, m in notes)  # num_nextn_predict_layers: 0

    monkeypatch.setattr(ds, "installed", lambda package: True)
    notes = _messages("kimi_k25", config)
    assert not [m for is_fatal, m in notes if is_fatal]
    assert any("dequantized" in m for _, m in notes)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_twins_have_no_fatal_notice(name: str) -> None:
    notes = _messages(name, twin_config_dict(FAMILIES[name]))
    assert not [m for fatal, m in notes if fatal]
    assert not any("MTP" in m for _, m in notes)


@pytest.mark.parametrize(
    "change",
    [
        {"scoring_func": "softmax"},
        {"topk_method": "greedy"},
        {"moe_layer_freq": 2},
        {"quantization_config": {"quant_method": "awq"}},
    ],
)
def test_what_transformers_would_silently_change_is_fatal(change: dict[str, Any]) -> None:
    config = {**config_for("deepseek-ai/DeepSeek-V3"), **change}  # type: ignore[dict-item]
    assert any(fatal for fatal, _ in _messages("deepseek_v3", config))
