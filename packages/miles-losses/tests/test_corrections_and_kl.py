"""Train–inference corrections (bounds, sequence products, metrics) and the KL estimators."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.core.config import ComponentRef
from miles.core.config.tools import ConfigError
from miles.core.contracts.components import Kind
from miles.core.registry.factory import build_component
from miles.losses.configs import IcePopConfig, MISConfig, TISConfig
from miles.losses.corrections import MIS, TIS, IcePop
from miles.losses.kl import k3, low_var_kl

torch.set_num_threads(1)
FAST = settings(max_examples=60, deadline=None)

Tokens = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@st.composite
def token_batches(draw: st.DrawFn) -> Tokens:
    """(old_logprobs, rollout_logprobs, loss_mask, seq_index) of a few packed sequences."""
    lens = draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))
    total = sum(lens)
    old = draw(st.lists(st.floats(-4, 0), min_size=total, max_size=total))
    diff = draw(st.lists(st.floats(-1.5, 1.5), min_size=total, max_size=total))
    mask = draw(st.lists(st.booleans(), min_size=total, max_size=total))
    old_t = torch.tensor(old, dtype=torch.float64)
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return old_t, old_t - torch.tensor(diff), torch.tensor(mask, dtype=torch.float64), seq


def _ratio(batch: Tokens, level: str = "token") -> torch.Tensor:
    """Reference ratio per token: exp(old - rollout), or per-sequence product over masked tokens."""
    old, rollout, mask, seq = batch
    token = torch.exp(old - rollout)
    if level == "token":
        return torch.where(mask > 0, token, torch.ones_like(token))
    out = torch.empty_like(token)
    for s in seq.unique():
        rows = seq == s
        out[rows] = torch.prod(torch.where(mask[rows] > 0, token[rows], 1.0))
    return out


def _check_metrics(metrics: dict[str, torch.Tensor], ratio, weights, keep, changed, mask) -> None:  # type: ignore[no-untyped-def]
    m = mask > 0
    n = max(int(m.sum()), 1)
    torch.testing.assert_close(metrics["train/is_ratio_mean"], ratio[m].sum() / n)
    torch.testing.assert_close(
        metrics["train/is_clipfrac"], (changed & m).sum().to(torch.float64) / n
    )
    w = (weights * keep)[m]
    ess = w.sum() ** 2 / (n * (w**2).sum()) if (w**2).sum() > 0 else torch.tensor(0.0)
    torch.testing.assert_close(metrics["train/ess_ratio"], ess.to(torch.float64))
    assert 0 <= float(metrics["train/ess_ratio"]) <= 1 + 1e-9
    for value in metrics.values():
        assert value.dim() == 0


@FAST
@given(token_batches(), st.sampled_from(["token", "sequence"]), st.floats(1.01, 5.0))
def test_tis_truncates_and_keeps_everything(batch: Tokens, level: str, cap: float) -> None:
    weights, keep, metrics = TIS(TISConfig(level=level, cap=cap))(*batch)
    ratio = _ratio(batch, level)
    assert (weights <= cap * (1 + 1e-12)).all() and (weights > 0).all()
    torch.testing.assert_close(weights, torch.clamp(ratio, max=cap))
    assert (keep == 1).all()
    if level == "sequence":  # one weight per sequence
        seq = batch[3]
        for s in seq.unique():
            assert weights[seq == s].unique().numel() == 1
    _check_metrics(metrics, ratio, weights, keep, ratio > cap, batch[2])


@FAST
@given(
    token_batches(),
    st.sampled_from(["token", "sequence"]),
    st.floats(0.0, 0.95),
    st.floats(1.05, 4.0),
)
def test_mis_masks_outside_bounds(batch: Tokens, level: str, low: float, high: float) -> None:
    weights, keep, metrics = MIS(MISConfig(level=level, low=low, high=high))(*batch)
    ratio = _ratio(batch, level)
    inside = (ratio >= low * (1 - 1e-12)) & (ratio <= high * (1 + 1e-12))
    near_bound = torch.isclose(ratio, torch.tensor(low, dtype=ratio.dtype)) | torch.isclose(
        ratio, torch.tensor(high, dtype=ratio.dtype)
    )
    assert torch.equal((keep > 0)[~near_bound], inside[~near_bound])
    torch.testing.assert_close(weights, ratio * keep)  # IS weight inside, 0 outside
    assert (weights <= high * (1 + 1e-9)).all()
    _check_metrics(metrics, ratio, weights, keep, keep == 0, batch[2])


@FAST
@given(token_batches(), st.floats(0.1, 0.9), st.floats(1.1, 6.0))
def test_icepop_is_token_level_two_sided_mask(batch: Tokens, low: float, high: float) -> None:
    weights, keep, metrics = IcePop(IcePopConfig(low=low, high=high))(*batch)
    ratio = _ratio(batch)
    expected = torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))
    torch.testing.assert_close(weights, expected)  # M(k) = k on [low, high], else 0
    torch.testing.assert_close(keep, (expected > 0).to(keep.dtype))
    mis = MIS(MISConfig(level="token", low=low, high=high))(*batch)
    torch.testing.assert_close(weights, mis[0])
    _check_metrics(metrics, ratio, weights, keep, keep == 0, batch[2])


def test_sequence_level_uses_the_product_of_masked_ratios() -> None:
    old = torch.tensor([-1.0, -1.0, -1.0, -2.0, -2.0])
    rollout = torch.tensor([-9.0, -1.5, -1.5, -2.0, -2.0])  # token 0 is a prompt token
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])
    seq = torch.tensor([0, 0, 0, 1, 1])
    weights, _, _ = TIS(TISConfig(level="sequence", cap=10.0))(old, rollout, mask, seq)
    torch.testing.assert_close(weights, torch.tensor([math.e] * 3 + [1.0] * 2))
    weights, keep, metrics = MIS(MISConfig(level="sequence", low=0.5, high=2.0))(
        old, rollout, mask, seq
    )
    assert keep.tolist() == [0, 0, 0, 1, 1]  # e > 2: the whole first sequence is dropped
    torch.testing.assert_close(metrics["train/is_clipfrac"], torch.tensor(0.5))
    with pytest.raises(ValueError, match="seq_index"):
        TIS(TISConfig(level="sequence"))(old, rollout, mask, None)


def test_equal_ratios_give_full_effective_sample_size() -> None:
    ones = torch.ones(4)
    _, _, metrics = TIS(TISConfig())(
        ones * -1.0, ones * -1.1, ones, torch.zeros(4, dtype=torch.long)
    )
    torch.testing.assert_close(metrics["train/ess_ratio"], torch.tensor(1.0))
    # Everything masked out: no effective samples, no NaN.
    _, _, metrics = IcePop(IcePopConfig())(
        ones * 0, ones * -5, ones, torch.zeros(4, dtype=torch.long)
    )
    assert float(metrics["train/ess_ratio"]) == 0.0 and float(metrics["train/is_clipfrac"]) == 1.0


def test_registered_corrections_validate_config() -> None:
    tis = build_component(Kind.CORRECTION, ComponentRef("tis", {"level": "sequence", "cap": 3}))
    assert isinstance(tis, TIS) and tis.config.cap == 3.0
    assert isinstance(build_component(Kind.CORRECTION, "icepop"), IcePop)
    with pytest.raises(ConfigError, match="level"):
        build_component(Kind.CORRECTION, ComponentRef("mis", {"level": "seq"}))
    with pytest.raises(ConfigError, match="low"):
        build_component(Kind.CORRECTION, ComponentRef("mis", {"low": 1.5}))


# ── KL estimators ────────────────────────────────────────────────────────────────────────────────


@FAST
@given(st.lists(st.tuples(st.floats(-60, 0), st.floats(-60, 0)), min_size=1, max_size=30))
def test_low_var_kl_is_clamped_k3(pairs: list[tuple[float, float]]) -> None:
    lp, ref = (torch.tensor(col, dtype=torch.float64) for col in zip(*pairs, strict=True))
    kl = low_var_kl()(lp, ref)
    assert torch.isfinite(kl).all() and (kl >= -1e-12).all() and (kl <= 10).all()
    moderate = (ref - lp).abs() < 2  # k3 < 10 there: no clamp
    torch.testing.assert_close(kl[moderate], k3()(lp, ref)[moderate])
    far = (ref - lp) > 3  # k3 = e^3 - 4 > 10
    assert (kl[far] == 10).all()


def test_low_var_kl_is_registered_and_differentiable() -> None:
    estimator = build_component(Kind.KL, "low_var_kl")
    lp = torch.tensor([-1.0, -30.0], requires_grad=True)
    kl = estimator(lp, torch.tensor([-1.5, -1.0]))
    kl.sum().backward()
    assert lp.grad is not None and lp.grad[1] == 0  # clamped: no gradient from the outlier
    assert np.isfinite(lp.grad.numpy()).all()


@pytest.mark.parametrize("name", ["tis", "mis", "icepop"])
def test_corrections_answer_numpy_in_numpy_as_the_run_calls_them(name: str) -> None:
    """The train rank calls corrections with numpy arrays (miles-core has no torch): the same
    weights, mask and metrics as on tensors, as numpy arrays and floats."""
    correction = build_component(Kind.CORRECTION, name)
    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.3, 12).astype(np.float32)
    rollout = (old + rng.normal(0, 0.8, 12)).astype(np.float32)
    mask = np.ones(12, np.float32)
    seq = np.repeat(np.arange(3), 4).astype(np.int64)
    weights, keep, metrics = correction(old, rollout, mask, seq)
    assert isinstance(weights, np.ndarray) and isinstance(keep, np.ndarray)
    assert all(type(v) is float for v in metrics.values())
    t_weights, t_keep, t_metrics = correction(
        *(torch.from_numpy(a) for a in (old, rollout, mask, seq))
    )
    np.testing.assert_array_equal(weights, t_weights.numpy())
    np.testing.assert_array_equal(keep, t_keep.numpy())
    assert metrics == {k: float(v) for k, v in t_metrics.items()}


@pytest.mark.parametrize("name", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_on_numpy_match_torch(name: str) -> None:
    kl = build_component(Kind.KL, name)
    lp = np.array([-1.0, -2.0, -0.5], np.float32)
    ref = np.array([-1.5, -1.0, -0.5], np.float32)
    on_numpy = kl(lp, ref)
    assert isinstance(on_numpy, np.ndarray)
    np.testing.assert_array_equal(on_numpy, kl(torch.from_numpy(lp), torch.from_numpy(ref)).numpy())
