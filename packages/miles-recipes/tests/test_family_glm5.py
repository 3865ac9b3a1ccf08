"""The GLM-5 / GLM-5.1 family (`glm_moe_dsa`): exact sizes against transformers, the tiny twin,
routing replay through the reused sigmoid router adapter, the DSA indexer's (absent) gradients,
the FP8 checkpoint load, and the notices."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from miles.core.contracts.family import ModelShape, RouterAdapter
from miles.recipes.families.glm5 import glm_moe_dsa, indexer_types
from miles.recipes.twins import write_twin
from miles.torch.models import load_causal_lm
from miles.torch.routing import RoutingRecorder, RoutingReplay

ARCHITECTURES = Path(__file__).parents[1] / "src/miles/recipes/architectures"
REAL = {
    name: json.loads((ARCHITECTURES / f"{name}.json").read_text())["config"]
    for name in ("zai-org__GLM-5", "zai-org__GLM-5.1")
}
FAMILY = glm_moe_dsa()


# The family's optional parts, all present for this family.
def _shape(config: dict[str, Any]) -> ModelShape:
    assert FAMILY.shape is not None
    return FAMILY.shape(config)


def _router() -> RouterAdapter:
    assert FAMILY.router is not None
    return FAMILY.router


def _variants() -> dict[str, dict[str, Any]]:
    assert FAMILY.tiny is not None
    tiny = FAMILY.tiny()
    return {
        **REAL,
        "tiny": tiny,
        # GLM-5.2-style IndexShare (layers without an indexer), an explicit pattern, and the
        # optional fields the real checkpoints leave at their defaults.
        "index_share": {**tiny, "num_hidden_layers": 4, "index_topk_freq": 2},
        "index_pattern": {**tiny, "index_topk_pattern": "FSF"},
        "biased_tied": {**tiny, "attention_bias": True, "tie_word_embeddings": True},
        "defaults_only": {"model_type": "glm_moe_dsa", "num_hidden_layers": 5},
    }


def _transformers_count(config: dict[str, Any]) -> int:
    fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            AutoConfig.for_model("glm_moe_dsa", **fields)
        )
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(_variants()))
def test_shape_counts_what_transformers_builds(name: str) -> None:
    config = _variants()[name]
    shape = _shape(config)
    expected = _transformers_count(config)
    # GlmMoeDsaForCausalLM is both the checkpoint's class and what Miles loads.
    assert shape.params.total == shape.params.language_model == expected
    assert shape.params.vision == 0
    assert shape.kv_elems_per_token > 0 and shape.act_elems_per_token > 0


def test_shape_of_real_checkpoints() -> None:
    for config in REAL.values():
        shape = _shape(config)
        # MLA latent + rope key on 78 layers, plus the indexer key (all layers are "full").
        assert shape.kv_elems_per_token == 78 * (512 + 64 + 128)
        assert shape.active_expert_params == 75 * 8 * 3 * 6144 * 2048
    # The published safetensors total of GLM-5.1 (753,864,139,008) is the language model plus
    # its MTP layer (one more decoder layer, eh_proj, enorm, hnorm, shared_head.norm) and the
    # 76 routers' e_score_correction_bias buffers.
    config = REAL["zai-org__GLM-5.1"]
    base = _shape(config).params.total
    one_more = _shape({**config, "num_hidden_layers": 79}).params.total
    hidden = 6144
    mtp = (one_more - base) + hidden * 2 * hidden + 3 * hidden
    assert base + mtp + 76 * 256 == 753_864_139_008


def test_indexer_schedule_follows_transformers() -> None:
    for name, config in _variants().items():
        fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
        built = AutoConfig.for_model("glm_moe_dsa", **fields)
        ours = indexer_types({"num_hidden_layers": built.num_hidden_layers, **fields})
        assert ours == built.indexer_types, name


def test_parallel_hints() -> None:
    assert FAMILY.parallel is not None
    hints = FAMILY.parallel(REAL["zai-org__GLM-5.1"])
    assert hints.problems(tensor=8, expert=64, where="glm") == []
    assert hints.problems(tensor=1, expert=48, where="glm")  # 256 experts over 48 ranks


# --- the tiny twin ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.set_num_threads(1)
    return str(write_twin(FAMILY, tmp_path_factory.mktemp("glm5"), seed=1))


def _load(path: str, **kwargs: Any) -> Any:
    """As Miles loads it: through `load_causal_lm` (GLM-5 needs no family loader)."""
    return load_causal_lm(path, dtype=torch.float32, **kwargs).eval()


def _tokens(n: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 28, (2, n), generator=torch.Generator().manual_seed(seed))


def test_twin_trains_except_the_indexer(twin: str) -> None:
    model = _load(twin).train()
    assert type(model).__name__ == "GlmMoeDsaForCausalLM"
    tokens = _tokens()
    out = model(input_ids=tokens, labels=tokens)
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    for name, param in model.named_parameters():
        got = param.grad is not None and bool(param.grad.abs().sum() > 0)
        # transformers runs the DSA indexer under no_grad: exactly its weights get nothing.
        assert got != (".indexer." in name), name


def test_twin_attends_sparsely(twin: str) -> None:
    """index_topk (8) is below the sequence length, so the indexer's mask changes the output;
    with every key selected the model is dense MLA."""
    tokens = _tokens()
    with torch.no_grad():
        sparse = _load(twin)(input_ids=tokens).logits
        dense = _load(twin, index_topk=64)(input_ids=tokens).logits
        short = _load(twin)(input_ids=tokens[:, :8]).logits
        short_dense = _load(twin, index_topk=64)(input_ids=tokens[:, :8]).logits
    assert not torch.allclose(sparse, dense)
    torch.testing.assert_close(short, short_dense)


def test_routers_are_the_moe_layers(twin: str) -> None:
    model = _load(twin)
    routers = _router().routers(model)
    moe = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    assert routers == moe and len(routers) == len(model.model.layers) - 1


def test_gate_weights_match_the_router(twin: str) -> None:
    model = _load(twin)
    adapter = _router()
    seen: list[tuple[Any, Any]] = []
    for router in adapter.routers(model):
        router.register_forward_hook(lambda m, a, out: seen.append((m, out)))
    with torch.no_grad():
        model(input_ids=_tokens())
    assert len(seen) == 2
    for router, (logits, weights, indices) in seen:
        again = adapter.gate_weights(router, logits, indices)
        torch.testing.assert_close(again, weights, rtol=0, atol=1e-6)
    # And with gradient through the logits.
    router, (logits, _, indices) = seen[0]
    logits = logits.clone().requires_grad_()
    adapter.gate_weights(router, logits, indices).sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def _record(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    recorder = RoutingRecorder(model, _router(), with_weights=False)
    with torch.no_grad():
        model(input_ids=tokens)
    indices, _ = recorder.take()
    return indices


def test_routing_replay(twin: str) -> None:
    tokens = _tokens()
    indices = _record(_load(twin), tokens)
    assert indices.shape == (2 * 32, 2, 2)
    model = _load(twin)
    replay = RoutingReplay(model, _router(), "ids")
    with torch.no_grad():
        plain = model(input_ids=tokens).logits
        with replay.active(indices):
            same = model(input_ids=tokens).logits
        with replay.active((indices + 1) % 8):
            other = model(input_ids=tokens).logits
    torch.testing.assert_close(same, plain, atol=1e-5, rtol=0)
    assert not torch.allclose(other, plain, atol=1e-3)
    with replay.active((indices + 1) % 8):
        model(input_ids=tokens).logits.logsumexp(-1).mean().backward()
    for router in _router().routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


# --- FP8 checkpoints ----------------------------------------------------------------------


def _fp8_blocks(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style block FP8: e4m3 values and one fp32 scale (weight_scale_inv) per block."""
    rows, cols = weight.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = weight
    blocks = padded.view(br, block, bc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    fp8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return fp8.view(br * block, bc * block)[:rows, :cols].contiguous(), scale


def _dequantized(fp8: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    rows, cols = fp8.shape
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return fp8.float() * full[:rows, :cols]


def test_fp8_checkpoint_loads_dequantized(
    twin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint in the zai-org/GLM-5-FP8 layout (quant_method fp8, 128x128 e4m3 blocks,
    per-expert weights) loads as the full-precision model Miles trains, and saves back as an
    unquantized glm_moe_dsa checkpoint."""
    from safetensors.torch import load_file, save_file

    skip = ("lm_head", "embed_tokens", "norm", "mlp.gate.", "weights_proj")
    tensors: dict[str, torch.Tensor] = {}
    for name, weight in load_file(f"{twin}/model.safetensors").items():
        if weight.ndim == 2 and name.endswith(".weight") and not any(s in name for s in skip):
            tensors[name], tensors[name + "_scale_inv"] = _fp8_blocks(weight)
        else:
            tensors[name] = weight.to(torch.bfloat16)
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    save_file(tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads(Path(twin, "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.embed_tokens"]
        + [f"model.layers.{i}.self_attn.indexers_proj" for i in range(3)],
    }
    (fp8_dir / "config.json").write_text(json.dumps(config))
    notes = FAMILY.notices(config)
    assert any("FP8" in n.message and not n.fatal for n in notes)

    # On CPU transformers dequantizes by itself; on a GPU it would not: the family asks for it.
    import transformers

    asked: list[Any] = []
    real_load = transformers.AutoModelForCausalLM.from_pretrained

    def spy(path: str, **kwargs: Any) -> Any:
        asked.append(kwargs.get("quantization_config"))
        return real_load(path, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model = _load(str(fp8_dir))
    monkeypatch.undo()
    assert asked and asked[0].dequantize is True
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert getattr(model.config, "quantization_config", None) is None
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    assert torch.equal(
        model.model.layers[0].self_attn.q_a_proj.weight,
        _dequantized(tensors[q_a], tensors[q_a + "_scale_inv"]),
    )
    up = "model.layers.1.mlp.experts.3.up_proj.weight"  # fused into gate_up_proj[3, I:]
    assert torch.equal(
        model.model.layers[1].mlp.experts.gate_up_proj[3, 32:],
        _dequantized(tensors[up], tensors[up + "_scale_inv"]),
    )
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_tokens()).logits).all()
    model.save_pretrained(str(tmp_path / "saved"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    assert type(again).__name__ == "GlmMoeDsaForCausalLM"
    torch.testing.assert_close(again.state_dict(), model.state_dict())


# --- notices ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REAL))
def test_notices_on_the_real_checkpoints(name: str) -> None:
    notes = FAMILY.notices(REAL[name])
    assert not any(n.fatal for n in notes)
    text = " ".join(n.message for n in notes)
    assert "MTP" in text and "model.layers.78" in text
    assert "indexer" in text and "no gradient" in text and "KL" in text
    assert "top-2048" in text


def test_notices_catch_other_models() -> None:
    config = REAL["zai-org__GLM-5.1"]
    for change in ({"scoring_func": "softmax"}, {"rope_interleave": False}):
        assert any(n.fatal for n in FAMILY.notices({**config, **change}))
    awq = {**config, "quantization_config": {"quant_method": "awq", "bits": 4}}
    assert any(n.fatal for n in FAMILY.notices(awq))
    no_mtp = {**config, "num_nextn_predict_layers": 0}
    assert not any("MTP" in n.message for n in FAMILY.notices(no_mtp))
