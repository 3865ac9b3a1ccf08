import copy

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from miles.precision.lora import (
    AdapterApplier,
    LoRAConfig,
    LoRALinear,
    adapter_named_weights,
    adapter_state_dict,
    apply_lora,
    load_adapter_state_dict,
    lora_modules,
    merged_named_weights,
)

torch.set_num_threads(1)

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 2, 4, 2, 16, 128


def tiny_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


@pytest.fixture
def base_model() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_config()).eval()


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


class Trainer:
    """A few Adam steps of next-token loss on fixed random tokens (enough to move every adapter)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.Adam(params, lr=1e-2)
        self.ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))

    def step(self, n: int = 1) -> float:
        for _ in range(n):
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
        return loss.item()


def lora_copy(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    lora = copy.deepcopy(model)
    apply_lora(lora, cfg)
    return lora


def test_config_validation() -> None:
    assert LoRAConfig(rank=4, alpha=8).scaling == 2.0
    for bad in (
        {"rank": 0},
        {"alpha": 0.0},
        {"dropout": 1.0},
        {"dropout": -0.1},
        {"targets": []},
        {"sync": "full"},
    ):
        with pytest.raises(ValueError):
            LoRAConfig(**bad)


def test_only_adapters_train_and_zero_b_is_identity(base_model, input_ids) -> None:
    rank = 4
    model = copy.deepcopy(base_model)
    replaced = apply_lora(model, LoRAConfig(rank=rank))

    assert len(replaced) == LAYERS * 4
    assert set(lora_modules(model)) == set(replaced)
    assert "model.layers.1.self_attn.v_proj" in replaced
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # r * (in + out) per target, from the config's dims: q, o are 64<->64, k, v are 64->32.
    q_out, kv_out = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    per_layer = (HIDDEN + q_out) + 2 * (HIDDEN + kv_out) + (q_out + HIDDEN)
    assert sum(p.numel() for p in trainable.values()) == LAYERS * rank * per_layer

    assert torch.equal(logits(model, input_ids), logits(base_model, input_ids))


def test_training_moves_only_adapters(base_model, input_ids) -> None:
    model = lora_copy(base_model, LoRAConfig(rank=4))
    frozen_before = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters_before = dict(adapter_state_dict(model))

    first = Trainer(model).step(4)

    assert not torch.allclose(logits(model, input_ids), logits(base_model, input_ids))
    for n, p in model.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n
            assert p.grad is None, n
    for n, t in adapter_named_weights(model):
        assert not torch.equal(t, adapters_before[n]), f"{n} did not train"
    assert first < 10.0  # a finite, sane loss


def test_merged_weights_load_into_plain_model(base_model, input_ids) -> None:
    model = lora_copy(base_model, LoRAConfig(rank=4, targets=["q_proj", "v_proj", "down_proj"]))
    Trainer(model).step(3)

    merged = dict(merged_named_weights(model))
    assert merged.keys() == base_model.state_dict().keys()
    plain = Qwen3ForCausalLM(tiny_config()).eval()
    plain.load_state_dict(merged, strict=True)

    torch.testing.assert_close(
        logits(plain, input_ids), logits(model, input_ids), atol=1e-5, rtol=0
    )
    # Untargeted tensors pass through untouched.
    key = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(merged[key], base_model.state_dict()[key])


def test_merged_weights_keep_bias_under_original_name() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential()
    plain.add_module("proj", nn.Linear(8, 6, bias=True))
    model = copy.deepcopy(plain)
    apply_lora(model, LoRAConfig(rank=2, targets=["proj"]))
    nn.init.normal_(model.proj.lora_B.weight)

    merged = dict(merged_named_weights(model))
    assert set(merged) == {"proj.weight", "proj.bias"}
    plain.load_state_dict(merged, strict=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(plain(x), model(x), atol=1e-6, rtol=0)


def test_adapter_applier_does_not_accumulate(base_model, input_ids) -> None:
    cfg = LoRAConfig(rank=4, alpha=8.0, sync="adapters")
    model = lora_copy(base_model, cfg)
    engine = copy.deepcopy(base_model)  # the rollout side: a plain model, no LoRA modules
    applier = AdapterApplier(engine, cfg.scaling)
    trainer = Trainer(model)

    for _ in range(3):  # several syncs: an accumulating applier is off from the second one on
        trainer.step(2)
        applied = applier.apply(adapter_named_weights(model))
        assert len(applied) == LAYERS * 4
        torch.testing.assert_close(
            logits(engine, input_ids), logits(model, input_ids), atol=1e-5, rtol=0
        )

    applier.reset()
    assert torch.equal(logits(engine, input_ids), logits(base_model, input_ids))


def test_adapter_applier_restores_dropped_targets_and_checks_shapes(base_model) -> None:
    model = lora_copy(base_model, LoRAConfig(rank=2, targets=["q_proj"]))
    for m in lora_modules(model).values():
        nn.init.normal_(m.lora_B.weight)
    engine = copy.deepcopy(base_model)
    applier = AdapterApplier(engine, 1.0)
    adapters = dict(adapter_named_weights(model))
    applier.apply(adapters.items())

    name = "model.layers.0.self_attn.q_proj"
    only_layer1 = {k: v for k, v in adapters.items() if not k.startswith(name)}
    applier.apply(only_layer1.items())
    assert torch.equal(engine.get_submodule(name).weight, base_model.get_submodule(name).weight)

    with pytest.raises(ValueError, match="lora_A and lora_B"):
        applier.apply([(f"{name}.lora_A.weight", adapters[f"{name}.lora_A.weight"])])
    k_name = "model.layers.0.self_attn.k_proj"  # 32 x 64: a q_proj (64 x 64) adapter can't fit
    with pytest.raises(ValueError, match="does not fit"):
        applier.apply(
            [
                (f"{k_name}.lora_A.weight", adapters[f"{name}.lora_A.weight"]),
                (f"{k_name}.lora_B.weight", adapters[f"{name}.lora_B.weight"]),
            ]
        )


def test_adapter_bytes_are_small(base_model) -> None:
    model = lora_copy(base_model, LoRAConfig(rank=4))
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in adapter_named_weights(model))
    full_bytes = sum(t.numel() * t.element_size() for _, t in merged_named_weights(model))
    ratio = adapter_bytes / full_bytes
    print(f"adapters {adapter_bytes} B vs full {full_bytes} B: {ratio:.2%}")
    assert 0 < ratio < 0.10


def test_unknown_target_lists_available_names(base_model) -> None:
    model = copy.deepcopy(base_model)
    with pytest.raises(ValueError) as err:
        apply_lora(model, LoRAConfig(targets=["q_proj", "qkv"]))
    assert str(err.value) == (
        "lora.targets: 'qkv' matches no module of Qwen3ForCausalLM; available: down_proj, "
        "gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"
    )
    # Nothing was replaced or frozen by the failed call.
    assert not lora_modules(model)
    assert all(p.requires_grad for p in model.parameters())

    apply_lora(model, LoRAConfig(rank=2))
    with pytest.raises(ValueError, match="already has LoRA"):
        apply_lora(model, LoRAConfig(rank=2))


class FakeQuantInt4Linear(nn.Module):
    """Not an nn.Linear: a float master weight, quantised to INT4 per row in every forward."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / in_features**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 7
        q = (w / scale).round().clamp(-8, 7) * scale
        return F.linear(x, w + (q - w).detach())  # straight-through estimator


class QuantBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = FakeQuantInt4Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x)


def test_lora_over_a_quantised_base() -> None:
    torch.manual_seed(0)
    block = QuantBlock()
    base_weight = block.q_proj.weight.detach().clone()
    x, y = torch.randn(32, 16), torch.randn(32, 8)
    base_out = block(x).detach()

    apply_lora(block, LoRAConfig(rank=4, targets=["q_proj"]))
    assert isinstance(block.q_proj, LoRALinear)
    assert isinstance(block.q_proj.base, FakeQuantInt4Linear)
    assert torch.equal(block(x), base_out)

    opt = torch.optim.Adam([p for p in block.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(20):
        loss = F.mse_loss(block(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())

    assert losses[-1] < losses[0]
    assert not block.q_proj.base.weight.requires_grad
    assert block.q_proj.base.weight.grad is None
    assert torch.equal(block.q_proj.base.weight, base_weight)


def test_adapter_checkpoint_round_trip(base_model, input_ids, tmp_path) -> None:
    cfg = LoRAConfig(rank=4)
    model = lora_copy(base_model, cfg)
    Trainer(model).step(2)
    path = tmp_path / "adapter.safetensors"
    save_file(adapter_state_dict(model), path)

    restored = lora_copy(base_model, cfg)
    assert not torch.equal(logits(restored, input_ids), logits(model, input_ids))
    state = load_file(path)
    load_adapter_state_dict(restored, state)
    assert torch.equal(logits(restored, input_ids), logits(model, input_ids))

    key = "model.layers.0.self_attn.k_proj.lora_B.weight"
    with pytest.raises(ValueError, match=f"shape mismatch: {key}"):
        load_adapter_state_dict(restored, {**state, key: torch.zeros(5, 4)})
    with pytest.raises(ValueError, match=f"missing: {key}"):
        load_adapter_state_dict(restored, {k: v for k, v in state.items() if k != key})
