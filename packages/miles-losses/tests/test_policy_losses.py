"""Property tests of the policy losses: formulas, gradients, clip bounds, and aggregation."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles.core.config import ComponentRef
from miles.core.config.tools import ConfigError
from miles.core.contracts.algorithm import loss_weights
from miles.core.contracts.components import Kind
from miles.core.contracts.protocols import LossInputs, PolicyLoss
from miles.core.contracts.types import PackedBatch
from miles.core.registry.factory import build_component
from miles.losses.configs import CISPOConfig, GSPOConfig, PPOClipConfig, ValueConfig
from miles.losses.policy import CISPOLoss, GSPOLoss, PPOClipLoss, ValueLoss

torch.set_num_threads(1)
FAST = settings(max_examples=40, deadline=None)


@dataclass
class Case:
    """A packed batch of sequences with per-token logprobs: what a train step sees."""

    lens: list[int]
    mask: np.ndarray  # [T] 0/1
    logprobs: np.ndarray  # [T]
    old: np.ndarray  # [T]
    adv_per_seq: np.ndarray  # [n]

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int64)

    @property
    def seq(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.lens)), self.lens)

    @property
    def advantages(self) -> np.ndarray:
        return (self.adv_per_seq[self.seq] * self.mask).astype(np.float32)

    def batch(self) -> PackedBatch:
        n, total = len(self.lens), int(sum(self.lens))
        return PackedBatch(
            tokens=np.zeros(total, np.int64),
            offsets=self.offsets,
            prompt_lens=np.zeros(n, np.int64),
            loss_mask=self.mask.astype(np.float32),
            rollout_logprobs=self.old.astype(np.float32),
            advantages=self.advantages,
            rewards=np.zeros(n, np.float32),
            sample_ids=np.arange(n),
            group_ids=np.zeros(n, np.int64),
        )

    def permuted(self, perm: list[int]) -> "Case":
        """The same sequences in another order."""
        idx = np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in perm])
        return Case(
            [self.lens[i] for i in perm],
            self.mask[idx],
            self.logprobs[idx],
            self.old[idx],
            self.adv_per_seq[perm],
        )


@st.composite
def cases(draw: st.DrawFn, max_log_ratio: float = 0.5) -> Case:
    lens = draw(st.lists(st.integers(1, 7), min_size=1, max_size=6))
    total = sum(lens)
    floats = st.floats(-3.0, -0.01)
    logprobs = np.array(draw(st.lists(floats, min_size=total, max_size=total)), np.float32)
    shift = st.floats(-max_log_ratio, max_log_ratio)
    old = logprobs + np.array(draw(st.lists(shift, min_size=total, max_size=total)), np.float32)
    mask = np.array(draw(st.lists(st.booleans(), min_size=total, max_size=total)), np.float32)
    adv = st.floats(-2.0, 2.0)
    adv_per_seq = np.array(draw(st.lists(adv, min_size=len(lens), max_size=len(lens))), np.float32)
    return Case(lens, mask, logprobs, old, adv_per_seq)


def inputs_for(
    case: Case, weights: np.ndarray, seqs: list[int] | None = None, old: np.ndarray | None = None
) -> tuple[LossInputs, np.ndarray]:
    """LossInputs of a micro-batch made of `seqs` (default: all), and its batch token indices.
    `logprobs` is a fresh leaf that requires grad."""
    seqs = list(range(len(case.lens))) if seqs is None else seqs
    off = case.offsets
    idx = np.concatenate([np.arange(off[i], off[i + 1]) for i in seqs])
    seq_index = np.concatenate([np.full(case.lens[i], row) for row, i in enumerate(seqs)])

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.tensor(a[idx], dtype=torch.float64)

    lp = t(case.logprobs).requires_grad_(True)
    old_lp = t(case.old if old is None else old)
    return (
        LossInputs(
            logprobs=lp,
            old_logprobs=old_lp,
            rollout_logprobs=old_lp,
            advantages=t(case.advantages),
            loss_mask=t(case.mask),
            loss_weights=t(weights),
            entropy=torch.zeros(len(idx), dtype=torch.float64),
            seq_index=torch.tensor(seq_index, dtype=torch.int64),
        ),
        idx,
    )


def objective(loss: PolicyLoss, inputs: LossInputs) -> torch.Tensor:
    per_token, _ = loss(inputs)
    return (per_token * inputs.loss_weights).sum()


LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": PPOClipLoss(PPOClipConfig(clip_low=0.2, clip_high=0.28)),
    "ppo_dual_clip": PPOClipLoss(PPOClipConfig(dual_clip=3.0)),
    "gspo": GSPOLoss(GSPOConfig()),
    "cispo": CISPOLoss(CISPOConfig(clip_low=0.2, clip_high=0.28)),
}
AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


# ── on-policy: every loss is REINFORCE ───────────────────────────────────────────────────────────


@FAST
@given(cases(), st.sampled_from(AGGREGATIONS))
def test_on_policy_gradient_is_reinforce(case: Case, aggregation: str) -> None:
    """With ratio 1 nothing is clipped and d objective / d logp = -A * w for every loss."""
    w = loss_weights(case.batch(), aggregation)  # type: ignore[arg-type]
    for name, loss in LOSSES.items():
        inputs, _ = inputs_for(case, w, old=case.logprobs)
        per_token, metrics = loss(inputs)
        (per_token * inputs.loss_weights).sum().backward()
        expected = -inputs.advantages * inputs.loss_weights
        assert inputs.logprobs.grad is not None
        torch.testing.assert_close(inputs.logprobs.grad, expected, msg=name)
        assert float(metrics["train/clipfrac"].sum()) == 0.0, name
        assert float(metrics["train/ppo_kl"].abs().max()) == 0.0, name


# ── PPO ──────────────────────────────────────────────────────────────────────────────────────────


@FAST
@given(cases(max_log_ratio=1.0), st.floats(0.05, 0.5), st.floats(0.05, 0.5))
def test_ppo_clip_gradient_and_bounds(case: Case, low: float, high: float) -> None:
    loss = PPOClipLoss(PPOClipConfig(clip_low=low, clip_high=high))
    inputs, _ = inputs_for(case, np.ones(sum(case.lens), np.float32))
    per_token, metrics = loss(inputs)
    per_token.sum().backward()
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs).detach()
    adv = inputs.advantages
    clipped = metrics["train/clipfrac"].bool()
    # Clipped exactly where the ratio left the trust region in the direction A pushes it.
    assert torch.equal(clipped, ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - low) & (adv < 0)))
    # The surrogate is pessimistic: never below the unclipped one, and equal inside the bounds.
    assert (per_token.detach() >= -ratio * adv - 1e-12).all()
    assert inputs.logprobs.grad is not None
    grad = inputs.logprobs.grad
    torch.testing.assert_close(grad[~clipped], (-adv * ratio)[~clipped])
    assert (grad[clipped] == 0).all()


@FAST
@given(cases(max_log_ratio=3.0), st.floats(1.5, 5.0))
def test_dual_clip_bounds_negative_advantage_loss(case: Case, c: float) -> None:
    inputs, _ = inputs_for(case, np.ones(sum(case.lens), np.float32))
    plain, _ = PPOClipLoss(PPOClipConfig())(inputs)
    dual, metrics = PPOClipLoss(PPOClipConfig(dual_clip=c))(inputs)
    adv = inputs.advantages
    neg = adv < 0
    assert (dual[neg] <= -c * adv[neg] + 1e-9).all()
    torch.testing.assert_close(dual[~neg], plain[~neg])  # A >= 0: dual-clip does nothing
    torch.testing.assert_close(torch.minimum(plain, -c * adv)[neg], dual[neg])
    hit = metrics["train/dual_clipfrac"].bool()
    assert not hit[~neg].any() and torch.equal(hit[neg], (plain > -c * adv)[neg])


def test_dual_clip_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        PPOClipConfig(dual_clip=1.0)
    with pytest.raises(ConfigError, match="dual_clip"):
        build_component(Kind.LOSS, ComponentRef("ppo_clip", {"dual_clip": 0.5}))


# ── GSPO ─────────────────────────────────────────────────────────────────────────────────────────


def _gspo_reference(case: Case, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level GSPO written per sequence: loss per token of sequence i is
    -min(s_i A_i, clip(s_i) A_i), with gradient through s_i (the mean log-ratio)."""
    lp = torch.tensor(case.logprobs, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(case.old, dtype=torch.float64)
    mask = torch.tensor(case.mask, dtype=torch.float64)
    losses = []
    for i, (a, b) in enumerate(zip(case.offsets[:-1], case.offsets[1:], strict=True)):
        m = mask[a:b]
        s = torch.exp(((lp[a:b] - old[a:b]) * m).sum() / m.sum().clamp(min=1))
        adv = float(case.adv_per_seq[i])
        seq_loss = -torch.minimum(s * adv, torch.clamp(s, 1 - low, 1 + high) * adv)
        losses.append(seq_loss.expand(b - a) * m)
    return torch.cat(losses), lp


@FAST
@given(cases(max_log_ratio=2e-3))
def test_gspo_token_matches_sequence_gspo(case: Case) -> None:
    """For sequence-constant advantages, GSPO-token has GSPO's value and gradient."""
    cfg = GSPOConfig()
    w = np.asarray(case.mask, np.float64)
    inputs, _ = inputs_for(case, w)
    per_token, metrics = GSPOLoss(cfg)(inputs)
    (per_token * inputs.loss_weights).sum().backward()
    ref, lp = _gspo_reference(case, cfg.clip_low, cfg.clip_high)
    ref.sum().backward()
    torch.testing.assert_close(per_token.detach() * inputs.loss_mask, ref.detach())
    assert inputs.logprobs.grad is not None and lp.grad is not None
    torch.testing.assert_close(inputs.logprobs.grad, lp.grad)
    # The whole sequence is clipped or none of it (its unmasked tokens have A = 0: never clipped).
    clip = metrics["train/clipfrac"]
    for a, b in zip(case.offsets[:-1], case.offsets[1:], strict=True):
        trained = clip[a:b][case.mask[a:b] > 0]
        assert trained.numel() == 0 or trained.min() == trained.max()


def test_gspo_ignores_unmasked_tokens_and_needs_seq_index() -> None:
    case = Case(
        [3, 2],
        np.array([0, 1, 1, 1, 1], np.float32),
        np.array([-1.0, -1.0, -1.0, -2.0, -2.0], np.float32),
        np.array([-9.0, -1.0, -1.0, -2.0, -2.0], np.float32),  # prompt token far off: ignored
        np.array([1.0, -1.0], np.float32),
    )
    inputs, _ = inputs_for(case, case.mask)
    _, metrics = GSPOLoss(GSPOConfig())(inputs)
    assert metrics["train/clipfrac"].sum() == 0
    inputs.seq_index = None
    with pytest.raises(ValueError, match="seq_index"):
        GSPOLoss(GSPOConfig())(inputs)


# ── CISPO ────────────────────────────────────────────────────────────────────────────────────────


@FAST
@given(cases(max_log_ratio=1.0), st.one_of(st.none(), st.floats(0.05, 0.9)), st.floats(0.05, 4))
def test_cispo_gradient_is_clipped_is_weighted_reinforce(
    case: Case, low: float | None, high: float
) -> None:
    inputs, _ = inputs_for(case, np.ones(sum(case.lens), np.float32))
    per_token, metrics = CISPOLoss(CISPOConfig(clip_low=low, clip_high=high))(inputs)
    per_token.sum().backward()
    ratio = torch.exp(inputs.logprobs - inputs.old_logprobs).detach()
    weight = ratio.clamp(min=None if low is None else 1 - low, max=1 + high)
    assert inputs.logprobs.grad is not None
    # Every token keeps a gradient (no token is dropped), scaled by the clipped weight.
    torch.testing.assert_close(inputs.logprobs.grad, -weight * inputs.advantages)
    torch.testing.assert_close(per_token.detach(), -weight * inputs.advantages * inputs.logprobs)
    assert torch.equal(metrics["train/clipfrac"].bool(), weight != ratio)


# ── value loss ───────────────────────────────────────────────────────────────────────────────────


@FAST
@given(
    st.lists(st.tuples(*[st.floats(-3, 3, width=32)] * 3), min_size=1, max_size=20),
    st.floats(0.05, 1.0),
)
def test_value_loss_is_clipped_squared_error(rows: list[tuple[float, float, float]], c: float):
    v, v_old, ret = (torch.tensor(col, dtype=torch.float64) for col in zip(*rows, strict=True))
    v = v.clone().requires_grad_(True)
    ones = torch.ones_like(ret)
    inputs = LossInputs(
        logprobs=ones,
        old_logprobs=ones,
        rollout_logprobs=ones,
        advantages=ones,
        loss_mask=ones,
        loss_weights=ones,
        entropy=ones,
        values=v,
        old_values=v_old,
        returns=ret,
    )
    loss, metrics = ValueLoss(ValueConfig(clip=c))(inputs)
    loss.sum().backward()
    err = (v.detach() - ret).square()
    assert (loss.detach() >= 0.5 * err - 1e-12).all()
    inside = (v.detach() - v_old).abs() <= c
    torch.testing.assert_close(loss.detach()[inside], 0.5 * err[inside])
    clipped = metrics["train/value_clipfrac"].bool()
    assert not clipped[inside].any()
    assert v.grad is not None
    assert (v.grad[clipped] == 0).all()
    torch.testing.assert_close(v.grad[~clipped], (v.detach() - ret)[~clipped])
    plain, _ = ValueLoss(ValueConfig(clip=None))(inputs)
    torch.testing.assert_close(plain.detach(), 0.5 * err)


def test_value_loss_needs_values() -> None:
    ones = torch.ones(2)
    inputs = LossInputs(ones, ones, ones, ones, ones, ones, ones)
    with pytest.raises(ValueError, match="values"):
        ValueLoss(ValueConfig())(inputs)


# ── aggregation: micro-batch splits and sequence order do not matter ─────────────────────────────


@FAST
@given(cases(max_log_ratio=1.0), st.sampled_from(AGGREGATIONS), st.randoms(use_true_random=False))
def test_objective_invariant_under_micro_batch_splits(case, aggregation, rnd) -> None:  # type: ignore[no-untyped-def]
    w = loss_weights(case.batch(), aggregation, seq_sum_normalizer=7.0)
    n = len(case.lens)
    order = rnd.sample(range(n), n)
    cuts = sorted(rnd.sample(range(1, n), rnd.randint(0, n - 1))) if n > 1 else []
    parts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
    for name, loss in LOSSES.items():
        full_inputs, _ = inputs_for(case, w)
        full = objective(loss, full_inputs)
        full.backward()
        total = torch.zeros((), dtype=torch.float64)
        grad = torch.zeros(sum(case.lens), dtype=torch.float64)
        for seqs in parts:
            mb, idx = inputs_for(case, w, seqs)
            value = objective(loss, mb)
            value.backward()
            total = total + value.detach()
            assert mb.logprobs.grad is not None
            grad[idx] = mb.logprobs.grad
        torch.testing.assert_close(total, full.detach(), msg=name)
        assert full_inputs.logprobs.grad is not None
        torch.testing.assert_close(grad, full_inputs.logprobs.grad, msg=name)


@FAST
@given(cases(max_log_ratio=1.0), st.sampled_from(AGGREGATIONS), st.randoms(use_true_random=False))
def test_objective_invariant_under_sequence_permutation(case, aggregation, rnd) -> None:  # type: ignore[no-untyped-def]
    perm = rnd.sample(range(len(case.lens)), len(case.lens))
    other = case.permuted(perm)
    for name, loss in LOSSES.items():
        a = objective(loss, inputs_for(case, loss_weights(case.batch(), aggregation))[0])
        b = objective(loss, inputs_for(other, loss_weights(other.batch(), aggregation))[0])
        torch.testing.assert_close(a.detach(), b.detach(), msg=name)


def test_registered_losses_build_from_config() -> None:
    gspo = build_component(Kind.LOSS, "gspo")
    assert isinstance(gspo, GSPOLoss) and (gspo.config.clip_low, gspo.config.clip_high) == (
        3e-4,
        4e-4,
    )
    cispo = build_component(Kind.LOSS, ComponentRef("cispo", {"clip_high": 0.28}))
    assert cispo.config.clip_low is None and cispo.config.clip_high == 0.28
    value = build_component(Kind.LOSS, ComponentRef("value", {"clip": None}))
    assert isinstance(value, ValueLoss) and value.config.clip is None
    with pytest.raises(ConfigError, match="clip_low"):
        build_component(Kind.LOSS, ComponentRef("gspo", {"clip_low": 1.5}))
