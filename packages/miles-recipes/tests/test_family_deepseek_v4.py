"""The DeepSeek-V4 family (`deepseek_v4`): exact sizes against transformers on the released
configs, the tiny twin (every attention and router kind), routing replay through both router
kinds, the indexer's (absent) gradients, the FP8/FP4 release layout loading dequantized, the
notices, and the chat template against the release's encoder rules."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from miles.core.contracts.family import ModelShape, RouterAdapter
from miles.recipes.families.deepseek_v4 import (
    CSA,
    HCA,
    SLIDING,
    deepseek_v4,
    layer_types,
    mlp_layer_types,
)
from miles.recipes.twins import write_twin
from miles.torch.models import load_causal_lm
from miles.torch.routing import RoutingRecorder, RoutingReplay

ARCHITECTURES = Path(__file__).parents[1] / "src/miles/recipes/architectures"
REAL = {
    name: json.loads((ARCHITECTURES / f"deepseek-ai__DeepSeek-V4-{name}.json").read_text())[
        "config"
    ]
    for name in ("Flash", "Pro")
}
FAMILY = deepseek_v4()
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _shape(config: dict[str, Any]) -> ModelShape:
    assert FAMILY.shape is not None
    return FAMILY.shape(config)


def _router() -> RouterAdapter:
    assert FAMILY.router is not None
    return FAMILY.router


def _tiny() -> dict[str, Any]:
    assert FAMILY.tiny is not None
    return FAMILY.tiny()


def _variants() -> dict[str, dict[str, Any]]:
    tiny = _tiny()
    legacy = {k: v for k, v in tiny.items() if k not in ("layer_types", "mlp_layer_types")}
    return {
        **REAL,
        "tiny": tiny,
        # The checkpoints' legacy fields (per-layer ratios, hash-layer count, scalar rates).
        "legacy": {
            **legacy,
            "compress_ratios": [0, 4, 128, 4, 0],
            "num_hash_layers": 1,
            "compress_rate_hca": 16,
        },
        # transformers' default schedule, and the optional fields the releases leave unset.
        "default_schedule": {
            **tiny,
            "layer_types": None,
            "mlp_layer_types": None,
            "num_hidden_layers": 5,
            "tie_word_embeddings": True,
            "mlp_bias": True,
        },
        "defaults_only": {"model_type": "deepseek_v4", "num_hidden_layers": 3},
    }


def _transformers_fields(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in ("model_type", "architectures")}


def _transformers_count(config: dict[str, Any]) -> int:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            AutoConfig.for_model("deepseek_v4", **_transformers_fields(config))
        )
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(_variants()))
def test_shape_counts_what_transformers_builds(name: str) -> None:
    config = _variants()[name]
    shape = _shape(config)
    # DeepseekV4ForCausalLM is both the checkpoint's class and what Miles loads.
    assert shape.params.total == shape.params.language_model == _transformers_count(config)
    assert shape.params.vision == 0
    assert shape.kv_elems_per_token > 0 and shape.state_elems_per_seq > 0
    assert shape.act_elems_per_token > 0


@pytest.mark.parametrize("name", sorted(_variants()))
def test_layer_schedule_follows_transformers(name: str) -> None:
    config = _variants()[name]
    built = AutoConfig.for_model("deepseek_v4", **_transformers_fields(config))
    fields = {"num_hidden_layers": built.num_hidden_layers, "num_hash_layers": 3, **config}
    assert layer_types(fields) == built.layer_types
    assert mlp_layer_types(fields) == built.mlp_layer_types


def test_shape_of_real_checkpoints() -> None:
    flash, pro = REAL["Flash"], REAL["Pro"]
    # Flash: 2 sliding-window layers, then CSA / HCA alternating (21 CSA, 20 HCA); Pro: 2 HCA
    # layers, then CSA / HCA (30 CSA, 31 HCA). The lists' last entry (the MTP block) is cut.
    assert [layer_types(flash).count(k) for k in (SLIDING, CSA, HCA)] == [2, 21, 20]
    assert [layer_types(pro).count(k) for k in (SLIDING, CSA, HCA)] == [0, 30, 31]
    # Per token: CSA caches a 512-wide entry and a 128-wide indexer key per 4 tokens, HCA a
    # 512-wide entry per 128 tokens.
    assert _shape(flash).kv_elems_per_token == 21 * (512 + 128) // 4 + 20 * 512 // 128
    assert _shape(pro).kv_elems_per_token == 30 * (512 + 128) // 4 + 31 * 512 // 128
    # Per sequence: every layer's 128-token window, and the compressors' pending state.
    csa_state, hca_state = 2 * 8 * 1024 + 2 * 8 * 256, 2 * 128 * 512
    assert _shape(flash).state_elems_per_seq == 43 * 128 * 512 + 21 * csa_state + 20 * hca_state
    # Model cards: 284B total / 13B active (Flash), 1.6T / 49B (Pro), MTP block included.
    assert round(_shape(flash).params.total / 1e9) == 284
    assert round(_shape(pro).params.total / 1e12, 1) == 1.6
    for config, layers in ((flash, 43), (pro, 61)):
        hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
        assert _shape(config).active_expert_params == layers * 6 * 3 * hidden * inter


def test_parallel_hints() -> None:
    assert FAMILY.parallel is not None
    hints = FAMILY.parallel(REAL["Flash"])
    assert hints.problems(tensor=8, expert=64, where="v4") == []
    assert hints.problems(tensor=1, expert=48, where="v4")  # 256 experts over 48 ranks
    assert FAMILY.parallel(REAL["Pro"]).problems(tensor=16, expert=128, where="v4") == []


# --- the tiny twin ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def twin(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.set_num_threads(1)
    return str(write_twin(FAMILY, tmp_path_factory.mktemp("deepseek_v4"), seed=1))


def _load(path: str, **kwargs: Any) -> Any:
    """As Miles loads it: through `load_causal_lm`, which uses this family's `load`."""
    assert FAMILY.load is not None
    return load_causal_lm(path, dtype=torch.float32, **kwargs).eval()


def _tokens(n: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 28, (2, n), generator=torch.Generator().manual_seed(seed))


def test_twin_trains_except_the_indexer(twin: str) -> None:
    # The trainer asks for sdpa; transformers has only eager attention for DeepSeek-V4.
    model = _load(twin, attn_implementation="sdpa").train()
    assert type(model).__name__ == "DeepseekV4ForCausalLM"
    assert model.config._attn_implementation == "eager"
    assert [layer.self_attn.layer_type for layer in model.model.layers] == _tiny()["layer_types"]
    tokens = _tokens()
    out = model(input_ids=tokens, labels=tokens)
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    for name, param in model.named_parameters():
        got = param.grad is not None and bool(param.grad.abs().sum() > 0)
        # The indexer only hands top-k indices on: exactly its weights get no gradient.
        assert got != (".indexer." in name), name


def test_twin_attends_sparsely(twin: str) -> None:
    """The indexer keeps 2 compressed entries; a 32-token sequence has up to 8 per CSA layer,
    so the selection changes the output. At 8 tokens (2 entries) it selects all of them."""
    tokens = _tokens()
    with torch.no_grad():
        sparse = _load(twin)(input_ids=tokens).logits
        dense = _load(twin, index_topk=64)(input_ids=tokens).logits
        short = _load(twin)(input_ids=tokens[:, :8]).logits
        short_dense = _load(twin, index_topk=64)(input_ids=tokens[:, :8]).logits
    assert not torch.allclose(sparse, dense)
    torch.testing.assert_close(short, short_dense)


def test_cached_decode_matches_the_training_forward(twin: str) -> None:
    """Engines decode through transformers' V4 cache (window, compressed entries, indexer keys,
    pending compressor windows); the trainer runs one cache-free forward. Both give the same
    logits, whatever the prefill length."""
    from transformers import DynamicCache

    model = _load(twin)
    tokens = _tokens(n=40)[:1]
    with torch.no_grad():
        full = model(input_ids=tokens).logits
        for prefill in (1, 13, 32):
            cache = DynamicCache(config=model.config)
            steps = [model(input_ids=tokens[:, :prefill], cache=cache, use_cache=True).logits]
            for t in range(prefill, 40):
                steps.append(model(input_ids=tokens[:, t : t + 1], cache=cache).logits)
            torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)


def _routed(path: str) -> Any:
    """The twin with a random token -> experts table in its hash layers (transformers
    initialises tid2eid to zeros; the real one comes from the checkpoint)."""
    model = _load(path)
    generator = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            for row in layer.mlp.gate.tid2eid:  # two distinct experts per token id
                row.copy_(torch.randperm(8, generator=generator)[:2])
    return model


def test_routers_are_every_layer_of_both_kinds(twin: str) -> None:
    model = _load(twin)
    routers = _router().routers(model)
    assert routers == [layer.mlp.gate for layer in model.model.layers]
    kinds = [type(router).__name__ for router in routers]
    assert kinds == ["DeepseekV4HashRouter"] * 2 + ["DeepseekV4TopKRouter"] * 2


def test_gate_weights_match_both_router_kinds(twin: str) -> None:
    model = _routed(twin)
    adapter = _router()
    seen: list[tuple[Any, Any]] = []
    for router in adapter.routers(model):
        router.register_forward_hook(lambda m, a, out: seen.append((m, out)))
    with torch.no_grad():
        model(input_ids=_tokens())
    assert len(seen) == 4
    for router, (logits, weights, indices) in seen:
        torch.testing.assert_close(
            adapter.gate_weights(router, logits, indices), weights, rtol=0, atol=1e-6
        )
        # With gradient through the logits, for either kind.
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
    indices = _record(_routed(twin), tokens)
    assert indices.shape == (2 * 32, 4, 2)
    model = _routed(twin)
    # The hash layers' record is the table lookup: replaying it is the live choice.
    for layer in (0, 1):
        table = model.model.layers[layer].mlp.gate.tid2eid
        assert torch.equal(indices[:, layer], table[tokens.reshape(-1)])
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


# --- the FP8 / FP4 release layout ---------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_WEIGHTS = tuple(
    f".{name}.weight"
    for name in (
        "attn.wq_a",
        "attn.wq_b",
        "attn.wkv",
        "attn.wo_a",
        "attn.wo_b",
        "indexer.wq_b",
        "shared_experts.w1",
        "shared_experts.w2",
        "shared_experts.w3",
    )
)


def _pow2(amax: torch.Tensor, top: float) -> torch.Tensor:
    """ue8m0 scales: the power of two that brings amax within the format's range."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)))


def _fp8(weight: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 values, one e8m0 scale per 128x128 block, the dequantized weight)."""
    rows, cols = weight.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.zeros(br * block, bc * block)
    padded[:rows, :cols] = weight
    blocks = padded.view(br, block, bc, block)
    scale = _pow2(blocks.abs().amax(dim=(1, 3)), 448.0)
    fp8 = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    full = (fp8.float() * scale[:, None, :, None]).view(br * block, bc * block)
    values = fp8.view(br * block, bc * block)[:rows, :cols].contiguous()
    return values, scale.to(torch.float8_e8m0fnu), full[:rows, :cols].contiguous()


def _fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e2m1 codes packed two per int8, low nibble first; one e8m0 scale per 32 values of a
    row; the dequantized weight), the release's expert format."""
    rows, cols = weight.shape
    groups = weight.view(rows, cols // 32, 32)
    scale = _pow2(groups.abs().amax(-1), 6.0)
    x = groups / scale[..., None]
    index = (x.abs()[..., None] - E2M1).abs().argmin(-1)
    negative = (x < 0) & (index > 0)
    full = E2M1[index] * torch.where(negative, -1.0, 1.0) * scale[..., None]
    codes = (index | negative.long() << 3).view(rows, cols)
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), full.view(rows, cols)


def _release_name(name: str) -> str:
    """The twin's saved weight name as the release names it (no `model.` prefix)."""
    name = name.removeprefix("model.")
    heads = {"embed_tokens.weight": "embed.weight"}
    heads.update({f"hc_head.hc_{p}": f"hc_head_{p}" for p in ("fn", "base", "scale")})
    return heads.get(name, name)


def test_release_checkpoint_loads_dequantized(twin: str, tmp_path: Path) -> None:
    """A checkpoint in the deepseek-ai/DeepSeek-V4 layout (release weight names, FP8 attention
    and shared experts with ue8m0 block scales, FP4 routed experts, quant_method fp8) loads as
    the full-precision model Miles trains, equal to the same weights stored unquantized, and
    saves back as a plain deepseek_v4 checkpoint."""
    from safetensors.torch import load_file, save_file

    release: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for saved, tensor in load_file(f"{twin}/model.safetensors").items():
        name = _release_name(saved)
        scale_name = name.removesuffix("weight") + "scale"
        if name.endswith(FP8_WEIGHTS):
            release[name], release[scale_name], plain[name] = _fp8(tensor)
        elif ".experts." in name and ".shared_experts." not in name:
            release[name], release[scale_name], plain[name] = _fp4(tensor)
        elif tensor.is_floating_point():
            release[name] = tensor.to(torch.bfloat16)
            plain[name] = release[name].float()
        else:  # tid2eid
            release[name] = plain[name] = tensor
    config = json.loads(Path(twin, "config.json").read_text())
    for directory, tensors in (("release", release), ("plain", plain)):
        (tmp_path / directory).mkdir()
        save_file(tensors, str(tmp_path / directory / "model.safetensors"))
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    config["expert_dtype"] = "fp4"
    config["quantization_config"] = dict(REAL["Flash"]["quantization_config"])
    (tmp_path / "release" / "config.json").write_text(json.dumps(config))
    notes = FAMILY.notices(config)
    assert any("FP8" in n.message and "fp4" in n.message and not n.fatal for n in notes)

    model = _load(str(tmp_path / "release"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert getattr(model.config, "quantization_config", None) is None
    expected = _load(str(tmp_path / "plain")).state_dict()
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for name, tensor in got.items():
        assert torch.equal(tensor, expected[name]), name
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=_tokens()).logits).all()
    model.save_pretrained(str(tmp_path / "saved"))
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    assert type(again).__name__ == "DeepseekV4ForCausalLM"
    torch.testing.assert_close(again.state_dict(), got, rtol=0, atol=0)


# --- notices ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REAL))
def test_notices_on_the_real_checkpoints(name: str) -> None:
    notes = FAMILY.notices(REAL[name])
    assert not any(n.fatal for n in notes)
    text = " ".join(n.message for n in notes)
    assert "MTP" in text and "mtp.*" in text
    assert "indexer" in text and "no gradient" in text and "KL" in text
    assert f"top-{REAL[name]['index_topk']}" in text
    assert "eager" in text and "FP8" in text and "fp4" in text


def test_notices_catch_other_models() -> None:
    config = REAL["Flash"]
    for change in ({"n_shared_experts": 2}, {"norm_topk_prob": False}):
        assert any(n.fatal for n in FAMILY.notices({**config, **change}))
    awq = {**config, "quantization_config": {"quant_method": "awq", "bits": 4}}
    assert any(n.fatal for n in FAMILY.notices(awq))
    no_mtp = {**config, "num_nextn_predict_layers": 0}
    assert not any("MTP" in n.message for n in FAMILY.notices(no_mtp))
    sliding_only = {**config, "compress_ratios": [0] * 44}
    assert not any("lightning indexer" in n.message for n in FAMILY.notices(sliding_only))


# --- chat template ------------------------------------------------------------------------


def _render(messages: list[dict[str, Any]], **kwargs: Any) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    assert FAMILY.chat_template is not None
    rendered, _ = render_jinja_template(  # annotated "-> str"; returns (texts, indices)
        [messages], chat_template=FAMILY.chat_template, bos_token=BOS, eos_token=EOS, **kwargs
    )  # type: ignore[str-unpack]
    return str(rendered[0])


def test_chat_mode_is_the_default() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "2+2?"},
    ]
    history = f"{BOS}Be brief.<｜User｜>Hi<｜Assistant｜></think>Hello!{EOS}<｜User｜>2+2?"
    assert _render(messages, add_generation_prompt=True) == history + "<｜Assistant｜></think>"
    assert _render(messages) == history
    done = [*messages, {"role": "assistant", "content": "4"}]
    assert _render(done) == history + f"<｜Assistant｜></think>4{EOS}"


def test_thinking_mode_keeps_only_the_last_turns_reasoning() -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "Q2"},
    ]
    prompt = _render(messages, add_generation_prompt=True, enable_thinking=True)
    assert (
        prompt
        == f"{BOS}<｜User｜>Q1<｜Assistant｜></think>A1{EOS}<｜User｜>Q2<｜Assistant｜><think>"
    )
    last = [messages[0], messages[1]]
    assert (
        _render(last, thinking=True) == f"{BOS}<｜User｜>Q1<｜Assistant｜><think>r1</think>A1{EOS}"
    )
    effort = _render(last[:1], add_generation_prompt=True, thinking=True, reasoning_effort="max")
    assert effort.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts")
    assert effort.endswith(
        "ensure absolutely no assumption is left unchecked.\n\n<｜User｜>Q1<｜Assistant｜><think>"
    )


def test_tools_calls_and_results() -> None:
    function = {
        "name": "get_weather",
        "description": "Météo",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    call = {
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "Sunny"},
        {"role": "tool", "content": "Warm"},
        {"role": "user", "content": "Thanks"},
    ]
    tools = [{"type": "function", "function": function}]
    prompt = _render(messages, tools=tools, add_generation_prompt=True)
    schema = json.dumps(function, ensure_ascii=False)
    assert prompt.startswith(f"{BOS}S\n\n## Tools\n\nYou have access to a set of tools")
    assert f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow" in prompt
    invoke = (
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>"
    )
    tail = (
        "tool calls.\n<｜User｜>Weather?<｜Assistant｜></think>"
        f"\n\n<｜DSML｜tool_calls>\n{invoke}\n{invoke}\n</｜DSML｜tool_calls>{EOS}"
        "<｜User｜><tool_result>Sunny</tool_result>\n\n<tool_result>Warm</tool_result>\n\nThanks"
        "<｜Assistant｜></think>"
    )
    assert prompt.endswith(tail)
    # With tools, thinking mode keeps every turn's reasoning; no system message: an empty one.
    thinking = _render(messages[1:], tools=tools, add_generation_prompt=True, thinking=True)
    assert thinking.startswith(f"{BOS}\n\n## Tools\n\n")
    assert "<｜User｜>Weather?<｜Assistant｜><think></think>\n\n<｜DSML｜tool_calls>" in thinking
    assert thinking.endswith("Thanks<｜Assistant｜><think>")
    bad = {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    with pytest.raises(Exception, match="must be a mapping"):
        _render([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [bad]}])


def test_chat_template_through_a_tokenizer(twin: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(twin)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "max 3 7"}],
        chat_template=FAMILY.chat_template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<｜User｜>max 3 7<｜Assistant｜></think>"  # this tokenizer has no BOS
