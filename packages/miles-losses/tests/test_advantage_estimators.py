"""Advantage estimators against straightforward per-group / per-sequence loops."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.core.config import ComponentRef
from miles.core.config.tools import ConfigError
from miles.core.contracts.components import Capability, Kind
from miles.core.registry.factory import build_component
from miles.core.registry.plugins import get_plugin_manager
from miles.losses.advantages import (
    GAEAdvantage,
    GRPOAdvantage,
    ReinforcePPAdvantage,
    RLOOAdvantage,
)
from miles.losses.configs import GRPOConfig, ReinforcePPConfig, RLOOConfig
from miles.losses.gae import compute_gae, terminal_rewards

FAST = settings(max_examples=60, deadline=None)

# Rewards with group ids drawn from a few values, in any order (ids need not be contiguous).
batches = st.integers(1, 24).flatmap(
    lambda n: st.tuples(
        st.lists(st.floats(-5, 5, width=32), min_size=n, max_size=n),
        st.lists(st.sampled_from([3, 7, 8, 42, 100]), min_size=n, max_size=n),
    )
)


def _arrays(batch: tuple[list[float], list[int]]) -> tuple[np.ndarray, np.ndarray]:
    rewards, groups = batch
    return np.array(rewards, dtype=np.float32), np.array(groups, dtype=np.int64)


def _rloo_loop(r: np.ndarray, g: np.ndarray) -> np.ndarray:
    out = np.zeros(len(r))
    for i in range(len(r)):
        others = [float(r[j]) for j in range(len(r)) if g[j] == g[i] and j != i]
        out[i] = r[i] - np.mean(others) if others else 0.0
    return out


@FAST
@given(batches)
def test_rloo_matches_leave_one_out_loop(batch: tuple[list[float], list[int]]) -> None:
    r, g = _arrays(batch)
    adv = RLOOAdvantage(RLOOConfig())(r, g)
    assert adv.dtype == np.float32 and adv.shape == r.shape
    np.testing.assert_allclose(adv, _rloo_loop(r, g), rtol=1e-5, atol=1e-5)


def test_rloo_is_scaled_group_centring() -> None:
    r = np.array([1.0, 0.0, 0.0, 1.0, 5.0], dtype=np.float32)
    g = np.array([0, 0, 0, 0, 1])
    adv = RLOOAdvantage(RLOOConfig())(r, g)
    np.testing.assert_allclose(adv[:4], 4 / 3 * (r[:4] - 0.5), rtol=1e-6)
    assert adv[4] == 0.0  # a group of one has no baseline


def _whiten_loop(x: np.ndarray, eps: float) -> np.ndarray:
    std = np.std(x, ddof=1) if len(x) > 1 else 0.0
    return (x - np.mean(x)) / (std + eps)


@FAST
@given(batches, st.booleans())
def test_reinforce_pp_matches_loop(batch: tuple[list[float], list[int]], baseline: bool) -> None:
    r, g = _arrays(batch)
    x = r.astype(np.float64)
    if baseline:
        x = np.array([x[i] - x[g == g[i]].mean() for i in range(len(x))])
    expected = _whiten_loop(x, 1e-6)
    adv = ReinforcePPAdvantage(ReinforcePPConfig(baseline=baseline))(r, g)
    np.testing.assert_allclose(adv, expected, rtol=1e-4, atol=1e-4)


def test_reinforce_pp_whitens_over_the_batch_not_the_group() -> None:
    r = np.array([1.0, 1.0, 0.0, 0.0], dtype=np.float32)
    g = np.array([0, 0, 1, 1])
    adv = ReinforcePPAdvantage(ReinforcePPConfig())(r, g)
    assert adv[0] > 0 > adv[2]  # groups with constant rewards still get signal
    assert abs(adv.mean()) < 1e-6 and abs(adv.std(ddof=1) - 1) < 1e-4
    # With the baseline every group is constant, so nothing is left to learn from.
    base = ReinforcePPAdvantage(ReinforcePPConfig(baseline=True))(r, g)
    np.testing.assert_allclose(base, 0.0)


@FAST
@given(batches, st.randoms(use_true_random=False))
def test_estimators_are_permutation_equivariant(batch, rnd) -> None:  # type: ignore[no-untyped-def]
    r, g = _arrays(batch)
    perm = np.array(rnd.sample(range(len(r)), len(r)))
    for estimator in (
        GRPOAdvantage(GRPOConfig()),
        RLOOAdvantage(RLOOConfig()),
        ReinforcePPAdvantage(ReinforcePPConfig(baseline=True)),
    ):
        np.testing.assert_allclose(
            estimator(r[perm], g[perm]), estimator(r, g)[perm], rtol=1e-5, atol=1e-5
        )


# ── GAE ──────────────────────────────────────────────────────────────────────────────────────────


def _gae_loop(rewards, values, offsets, mask, gamma, lam):  # type: ignore[no-untyped-def]
    adv = np.zeros(len(mask))
    for i in range(len(offsets) - 1):
        idx = [t for t in range(offsets[i], offsets[i + 1]) if mask[t] > 0]
        running = 0.0
        for k in reversed(range(len(idx))):
            next_value = values[idx[k + 1]] if k + 1 < len(idx) else 0.0
            delta = rewards[idx[k]] + gamma * next_value - values[idx[k]]
            running = delta + gamma * lam * running
            adv[idx[k]] = running
    returns = np.where(mask > 0, adv + values, 0.0)
    return adv, returns


packed = st.lists(st.integers(0, 9), min_size=1, max_size=6).flatmap(
    lambda lens: st.tuples(
        st.just(lens),
        st.lists(st.floats(-2, 2, width=32), min_size=sum(lens), max_size=sum(lens)),
        st.lists(st.floats(-2, 2, width=32), min_size=sum(lens), max_size=sum(lens)),
        st.lists(st.booleans(), min_size=sum(lens), max_size=sum(lens)),
        st.floats(0, 1),
        st.floats(0, 1),
    )
)


@FAST
@given(packed)
def test_gae_matches_reference_loop(case) -> None:  # type: ignore[no-untyped-def]
    lens, rewards, values, mask, gamma, lam = case
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    r, v = np.array(rewards, np.float32), np.array(values, np.float32)
    m = np.array(mask, np.float32)
    adv, ret = compute_gae(r, v, offsets, m, gamma, lam)
    ref_adv, ref_ret = _gae_loop(r, v, offsets, m, gamma, lam)
    assert adv.dtype == ret.dtype == np.float32
    np.testing.assert_allclose(adv, ref_adv, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(ret, ref_ret, rtol=1e-4, atol=1e-4)
    assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()


def test_gae_with_outcome_reward_and_no_critic_is_reward_to_go() -> None:
    # Two sequences; prompt tokens (mask 0) and a tool output in the middle are skipped.
    offsets = np.array([0, 5, 9])
    mask = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1], np.float32)
    token_r = terminal_rewards(np.array([2.0, -1.0], np.float32), offsets, mask)
    assert token_r.tolist() == [0, 0, 0, 0, 2.0, 0, 0, 0, -1.0]
    adv, ret = compute_gae(token_r, np.zeros(9, np.float32), offsets, mask, 1.0, 1.0)
    np.testing.assert_allclose(adv, [0, 2, 2, 0, 2, 0, 0, -1, -1])
    # gamma < 1 discounts by the number of *trained* tokens to the end, not raw positions.
    adv, _ = compute_gae(token_r, np.zeros(9, np.float32), offsets, mask, 0.5, 1.0)
    np.testing.assert_allclose(adv[:5], [0, 0.5, 1.0, 0, 2.0])
    # lam = 0: one-step TD errors.
    values = np.linspace(0.1, 0.9, 9).astype(np.float32)
    adv, ret = compute_gae(token_r, values, offsets, mask, 1.0, 0.0)
    np.testing.assert_allclose(adv[1], values[2] - values[1], rtol=1e-6)
    np.testing.assert_allclose(adv[2], values[4] - values[2], rtol=1e-6)
    np.testing.assert_allclose(ret[4], 2.0, rtol=1e-6)


def test_gae_component_needs_values() -> None:
    gae = build_component(Kind.ADVANTAGE, ComponentRef("gae", {"gamma": 0.9, "lam": 0.95}))
    assert isinstance(gae, GAEAdvantage)
    assert get_plugin_manager().get(Kind.ADVANTAGE, "gae").spec.has(Capability.NEEDS_VALUES)
    assert not get_plugin_manager().get(Kind.ADVANTAGE, "grpo").spec.has(Capability.NEEDS_VALUES)
    with pytest.raises(TypeError, match="value model"):
        gae(np.zeros(2, np.float32), np.zeros(2, np.int64))
    offsets, mask = np.array([0, 3]), np.ones(3, np.float32)
    zeros = np.zeros(3, np.float32)
    adv, _ = gae.token_advantages(np.array([1.0], np.float32), zeros, offsets, mask)
    np.testing.assert_allclose(adv, [0.9**2 * 0.95**2 * 1, 0.9 * 0.95, 1.0], rtol=1e-5)
    # A per-token penalty (KL as reward) is subtracted from every trained token's reward.
    penalty = np.array([0.1, 0.2, 0.3])
    adv, ret = gae.token_advantages(np.array([1.0], np.float32), zeros, offsets, mask, penalty)
    expected = compute_gae(np.array([-0.1, -0.2, 0.7], np.float32), zeros, offsets, mask, 0.9, 0.95)
    np.testing.assert_allclose(adv, expected[0], rtol=1e-6)
    np.testing.assert_allclose(ret, expected[1], rtol=1e-6)
    with pytest.raises(ConfigError, match="gamma"):
        build_component(Kind.ADVANTAGE, ComponentRef("gae", {"gamma": 1.5}))


def test_registered_estimators_build_from_config() -> None:
    r = np.array([1.0, 0.0, 0.5, 0.5], np.float32)
    g = np.array([0, 0, 1, 1])
    base = build_component(Kind.ADVANTAGE, ComponentRef("reinforce_pp_baseline"))
    assert base.config.baseline  # forced on by the registered factory
    plain = build_component(Kind.ADVANTAGE, ComponentRef("reinforce_pp", {"eps": 1e-3}))
    assert not plain.config.baseline and plain.config.eps == 1e-3
    rloo = build_component(Kind.ADVANTAGE, "rloo")
    np.testing.assert_allclose(rloo(r, g), [1.0, -1.0, 0.0, 0.0])
