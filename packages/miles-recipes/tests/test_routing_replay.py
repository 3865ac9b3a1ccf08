"""Routing replay through the families' router adapters, on real transformers MoE models
(Qwen3-MoE and DeepSeek-V3 with random weights): recording, replay of ids and of weights,
gradients, and the bf16-rollout / fp32-train evidence."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.recipes.families.deepseek_v3 import deepseek_v3
from miles.recipes.families.qwen3 import qwen3_moe
from miles.recipes.families.routers import moe_routers
from miles.torch.routing import RoutingRecorder, RoutingReplay
from miles.torch.testing import make_tiny_model

FAMILIES = {"qwen3_moe": qwen3_moe(), "deepseek_v3": deepseek_v3()}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.set_num_threads(1)
    path = make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param, seed=1)
    return request.param, path


def _load(path: str, dtype: torch.dtype = torch.float32) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _tokens(n: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(4, 128, (2, n), generator=torch.Generator().manual_seed(seed))


def _experts_seen(model: Any) -> list[torch.Tensor]:
    """Collects the expert indices each MoE layer's experts module really receives."""
    seen: list[torch.Tensor] = []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.register_forward_pre_hook(
                lambda module, args: seen.append(args[1].detach().clone())
            )
    return seen


def _record(model: Any, family: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    recorder = RoutingRecorder(model, family.router, with_weights=True)
    with torch.no_grad():
        model(input_ids=tokens)
    indices, weights = recorder.take()
    assert weights is not None
    return indices, weights


def test_the_adapter_finds_only_moe_layers(arch: Any) -> None:
    name, path = arch
    model = _load(path)
    expected = sum(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert len(moe_routers(model)) == expected > 0
    if name == "deepseek_v3":
        assert expected == len(model.model.layers) - 1  # the first layer is dense


@pytest.mark.parametrize("mode", ["ids", "ids+weights"])
def test_replaying_a_models_own_routing_changes_nothing(arch: Any, mode: str) -> None:
    name, path = arch
    family, tokens = FAMILIES[name], _tokens()
    indices, weights = _record(_load(path), family, tokens)
    model = _load(path)
    replay = RoutingReplay(model, family.router, mode)  # type: ignore[arg-type]
    with torch.no_grad():
        plain = model(input_ids=tokens).logits
        with replay.active(indices, weights):
            replayed = model(input_ids=tokens).logits
    torch.testing.assert_close(replayed, plain, atol=1e-5, rtol=0)


def test_replay_forces_the_recorded_experts_and_keeps_router_gradients(arch: Any) -> None:
    name, path = arch
    family, tokens = FAMILIES[name], _tokens()
    indices, _ = _record(_load(path), family, tokens)
    num_experts = int(indices.max()) + 1
    forced = (indices + 1) % num_experts  # other experts than the router's own choice
    model = _load(path)
    seen = _experts_seen(model)
    replay = RoutingReplay(model, family.router, "ids")  # type: ignore[arg-type]
    with replay.active(forced):
        logits = model(input_ids=tokens).logits
        logits.float().logsumexp(-1).mean().backward()
    assert len(seen) == forced.shape[1]
    for layer, used in enumerate(seen):
        assert torch.equal(used.long(), forced[:, layer].long())
    for router in moe_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_replayed_weights_come_from_the_record(arch: Any) -> None:
    name, path = arch
    family, tokens = FAMILIES[name], _tokens()
    indices, weights = _record(_load(path), family, tokens)
    model = _load(path)
    captured: list[torch.Tensor] = []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            layer.mlp.experts.register_forward_pre_hook(
                lambda module, args: captured.append(args[2].detach().clone())
            )
    replay = RoutingReplay(model, family.router, "ids+weights")  # type: ignore[arg-type]
    doubled = weights * 2
    with torch.no_grad(), replay.active(indices, doubled):
        model(input_ids=tokens)
    for layer, got in enumerate(captured):
        torch.testing.assert_close(got.float(), doubled[:, layer])


def test_replayed_match_counts_what_the_experts_receive(arch: Any) -> None:
    """`matched` (the trainer's `moe/replayed_match`) is measured at the experts' inputs: a
    replay that reaches them counts every recorded pair; indices rewritten between the router
    and the experts (a replay that did not take hold) count none."""
    name, path = arch
    family, tokens = FAMILIES[name], _tokens()
    indices, _ = _record(_load(path), family, tokens)
    num_experts = int(indices.max()) + 1
    model = _load(path)
    replay = RoutingReplay(model, family.router, "ids")  # type: ignore[arg-type]
    assert replay.verifies
    replay.counting = True
    with torch.no_grad(), replay.active(indices):
        model(input_ids=tokens)
    stats = replay.take_stats()
    assert stats.compared == indices.shape[0] * indices.shape[1] and stats.matched == stats.compared

    def rewrite(module: Any, args: Any, output: Any) -> Any:  # runs after the replay's hook
        logits, weights, chosen = output
        return logits, weights, (chosen + 1) % num_experts

    for router in moe_routers(model):
        router.register_forward_hook(rewrite)
    with torch.no_grad(), replay.active(indices):
        model(input_ids=tokens)
    stats = replay.take_stats()
    assert stats.compared > 0 and stats.matched == 0


def test_minus_one_keeps_the_live_choice(arch: Any) -> None:
    name, path = arch
    family, tokens = FAMILIES[name], _tokens()
    indices, _ = _record(_load(path), family, tokens)
    model = _load(path)
    seen = _experts_seen(model)
    forced = (indices + 1) % (int(indices.max()) + 1)
    forced[::2] = -1  # every other token: no record
    with torch.no_grad(), RoutingReplay(model, family.router, "ids").active(forced):  # type: ignore[arg-type]
        model(input_ids=tokens)
    # Unrecorded tokens keep the live choice (compared at the first MoE layer: replay upstream
    # changes the hidden states later layers see); recorded ones get the record everywhere.
    assert torch.equal(seen[0][::2].long(), indices[::2, 0].long())
    for layer, used in enumerate(seen):
        assert torch.equal(used[1::2].long(), forced[1::2, layer].long())


def _near_ties(path: str, out: Path) -> str:
    """The same model with each router's expert rows pulled together (a shared row plus 2% of
    their differences): router logits nearly tied, so the forward's precision picks the
    winners."""
    model = _load(path)
    with torch.no_grad():
        for router in moe_routers(model):
            shared = router.weight.mean(dim=0, keepdim=True)
            router.weight.copy_(shared + 0.02 * (router.weight - shared))
    model.save_pretrained(out)
    return str(out)


def _token_logprobs(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def test_bf16_rollout_fp32_training_evidence(
    arch: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rollout in bf16 and training in fp32 route near-tied tokens differently; replaying the
    rollout's experts makes the trainer use exactly those and brings its logprobs closer."""
    name, path = arch
    family = FAMILIES[name]
    tied = _near_ties(path, tmp_path / "tied")
    tokens = _tokens(n=64, seed=3)
    rollout = _load(tied, torch.bfloat16)
    recorder = RoutingRecorder(rollout, family.router, with_weights=False)
    with torch.no_grad():
        rollout_lp = _token_logprobs(rollout, tokens)
    record, _ = recorder.take()

    trainer = _load(tied)
    seen = _experts_seen(trainer)
    results = {}
    for mode in ("off", "ids"):
        replay = RoutingReplay(trainer, family.router, mode)  # type: ignore[arg-type]
        replay.counting = True
        seen.clear()
        with torch.no_grad(), replay.active(record):
            lp = _token_logprobs(trainer, tokens)
        stats = replay.take_stats()
        used_equal = all(torch.equal(u.long(), record[:, i].long()) for i, u in enumerate(seen))
        if mode == "ids":  # the replayed_match count agrees with what the experts saw
            assert used_equal == (stats.matched == stats.compared)
        results[mode] = (
            stats.agreed / stats.compared,
            (lp - rollout_lp).abs().mean().item(),
            used_equal,
        )
        replay.counting = False
        for router in moe_routers(trainer):  # drop this replay's hooks before the next
            router._forward_hooks.clear()
    with capsys.disabled():
        print(f"\n{name}: agreement, mean |logprob diff|, used==recorded: {results}")
    agreement, diff_off, used_off = results["off"]
    _, diff_ids, used_ids = results["ids"]
    assert agreement < 1.0  # without replay the trainer routes differently
    assert not used_off and used_ids  # with replay it uses exactly the recorded experts
    assert diff_ids < diff_off  # and its logprobs are closer to the rollout's
