"""Cross-checks Miles' RL losses and advantages against TRL, an independent implementation.

TRL's own code runs, not a re-typed copy: `GRPOTrainer._compute_loss` and the advantage code in
`GRPOTrainer/RLOOTrainer._generate_and_score_completions` are called unbound on a stand-in object
that holds only the attributes they read, with a fake model whose per-token log-probs come from
logits we own. Both sides see the same fp64 inputs; the loss value and its gradient w.r.t. those
logits must agree.

Mapping of TRL `loss_type` to Miles (asserted by the tests below):

    grpo     -> PPOClipLoss + seq_mean_token_mean
    dr_grpo  -> PPOClipLoss + seq_mean_token_sum, seq_sum_normalizer = max_completion_length
    dapo     -> PPOClipLoss + token_mean  (TRL's `num_items_in_batch` = loss tokens in the batch)
    bnpo     -> PPOClipLoss + token_mean  (per micro-batch in TRL; the same with one micro-batch)
    cispo    -> CISPOLoss + token_mean    (TRL's epsilon_high is the ratio cap itself: 1 + eps_high)
    grpo + importance_sampling_level="sequence" -> GSPOLoss + seq_mean_token_mean
    delta    -> PPOClipConfig.dual_clip   (INTELLECT-2 cap; same as dual-clip when delta > 1 + eps)

    scale_rewards="group" -> GRPOAdvantage(normalize_std=True, eps=1e-4)  (TRL's eps is 1e-4)
    scale_rewards="none"  -> GRPOAdvantage(normalize_std=False)
    RLOOTrainer, normalize_advantages=False -> RLOOAdvantage

Known differences, pinned by tests so that a change on either side shows: TRL's per-sequence
aggregations (grpo, dr_grpo) divide by all B sequences, Miles' by those with a trained token; and
Miles' default GRPO eps is 1e-6, not TRL's 1e-4. TRL's scale_rewards="batch" (group-centred
rewards over the batch's raw-reward std) has no Miles counterpart.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip(
    "trl",
    reason="cannot import trl, the test-only reference implementation these tests compare against "
    "(pip install -r tools/requirements-dev.txt)",
)

from trl import GRPOConfig as TRLGRPOConfig
from trl import RLOOConfig as TRLRLOOConfig
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.rloo_trainer import RLOOTrainer

from miles.core.contracts.algorithm import Aggregation, loss_weights, token_seq_index
from miles.core.contracts.protocols import LossInputs, PolicyLoss
from miles.core.contracts.types import PackedBatch
from miles.losses.advantages import GRPOAdvantage, RLOOAdvantage
from miles.losses.configs import (
    CISPOConfig,
    GRPOConfig,
    GSPOConfig,
    PPOClipConfig,
    RLOOConfig,
)
from miles.losses.policy import CISPOLoss, GSPOLoss, PPOClipLoss

# TRL's config is a TrainingArguments, which warns about its own deprecated fields.
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SEEDS = [0, 1, 2, 3]
TOL = {"rtol": 1e-6, "atol": 1e-6}  # fp64 on both sides; Miles' float32 loss weights bound it
PROMPT_LEN, MAX_COMPLETION, VOCAB = 3, 7, 11
TRL_ADV_EPS = 1e-4  # TRL: advantages / (std + 1e-4), hard-coded in _generate_and_score_completions


# --- TRL side -------------------------------------------------------------------------------------


class _SingleProcess:
    """The few `Accelerator` calls TRL's loss code makes, for one CPU process."""

    device = torch.device("cpu")
    num_processes, process_index, is_main_process = 1, 0, True

    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def gather(self, x: Any) -> Any:
        return x

    gather_for_metrics = gather

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


class _FusedHeadModel(torch.nn.Module):
    """Answers TRL's `model(..., labels=, fused_lm_head=True)` from logits we own.

    Like TRL's fused head, position j scores label j + 1 and unscored positions are 0.
    """

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits  # [B, L - 1, V], a leaf we take gradients against

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        fused_lm_head: bool,
    ) -> SimpleNamespace:
        assert fused_lm_head
        labels = labels[:, 1:]
        scored = labels != -100
        logp_all = torch.log_softmax(self.logits, dim=-1)
        logp = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        return SimpleNamespace(
            log_probs=logp.masked_fill(~scored, 0.0), entropy=entropy.masked_fill(~scored, 0.0)
        )


class _TRLStub:
    """A single-process, on-policy, non-vLLM, text-only trainer: what TRL's methods read."""

    def __init__(self, args: Any, model: torch.nn.Module) -> None:
        self.args = args
        self.beta = args.beta
        self.num_generations = args.num_generations
        self.mask_truncated_completions = args.mask_truncated_completions
        self.pad_to_multiple_of = None
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = self._entropy_bonus_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.environment_factories = self.environments = self.tools = None
        self.log_multimodal = False
        self.model = model
        self.model.is_gradient_checkpointing = False
        self.accelerator = _SingleProcess()
        self.state = SimpleNamespace(global_step=0)
        self._metrics: dict[str, Any] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._logs: dict[str, Any] = defaultdict(list)
        self._logs["rewards"] = defaultdict(list)
        self._logs["extra"] = defaultdict(list)
        self._pending_extra_logs: dict[str, Any] = {}
        self._pending_metrics: dict[str, Any] = {}


class _TRLGRPO(_TRLStub):
    _compute_loss = GRPOTrainer._compute_loss
    _get_per_token_logps_and_entropies = GRPOTrainer._get_per_token_logps_and_entropies
    _generate_and_score_completions = GRPOTrainer._generate_and_score_completions

    def __init__(self, args: TRLGRPOConfig, model: torch.nn.Module) -> None:
        super().__init__(args, model)
        # As GRPOTrainer.__init__ sets them from `args`.
        self.loss_type = args.loss_type
        self.epsilon_low = args.epsilon
        self.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
        self.importance_sampling_level = args.importance_sampling_level
        self.scale_rewards = args.scale_rewards
        self.max_completion_length = args.max_completion_length
        self.num_iterations = args.num_iterations
        self.multi_objective_aggregation = args.multi_objective_aggregation
        self.top_entropy_quantile = args.top_entropy_quantile
        self.off_policy_mask_threshold = args.off_policy_mask_threshold


class _TRLRLOO(_TRLStub):
    _get_per_token_logps_and_entropies = RLOOTrainer._get_per_token_logps_and_entropies
    _generate_and_score_completions = RLOOTrainer._generate_and_score_completions

    def __init__(self, args: TRLRLOOConfig, model: torch.nn.Module) -> None:
        super().__init__(args, model)
        # As RLOOTrainer.__init__ sets them from `args`.
        self.normalize_advantages = args.normalize_advantages
        self.reward_clip_range = args.reward_clip_range


def _trl_args(config: type = TRLGRPOConfig, **kw: Any) -> Any:
    return config(
        output_dir="/tmp/trl-crosscheck-unused",
        report_to=[],
        use_cpu=True,
        max_completion_length=MAX_COMPLETION,
        beta=0.0,
        **kw,
    )


def trl_advantages(stub: _TRLStub, rewards: np.ndarray) -> np.ndarray:
    """Runs TRL's `_generate_and_score_completions` with generation and reward functions stubbed."""
    n = len(rewards)
    stub.reward_func_names = ["fixed"]
    stub.reward_weights = torch.ones(1, dtype=torch.float64)
    stub._tokenizer = SimpleNamespace(pad_token_id=0)
    ids = [[1, 2]] * n
    if isinstance(stub, _TRLRLOO):
        stub._generate = lambda prompts: (ids, ids, ["c"] * n)
    else:
        stub._generate = lambda prompts: (ids, ids, None, ["c"] * n, None, {}, None, [None] * n)
    stub._calculate_rewards = lambda *a: torch.tensor(rewards, dtype=torch.float64)[:, None]
    out = stub._generate_and_score_completions([{"prompt": "p"}] * n)
    return out["advantages"].numpy()


def _scoring_model(n: int) -> torch.nn.Module:
    # RLOO scores the (2 + 2)-token sequences with the policy even when nothing trains.
    return _FusedHeadModel(torch.zeros(n, 3, VOCAB, dtype=torch.float64))


# --- shared random inputs -------------------------------------------------------------------------


class Case:
    """One batch: B sequences of PROMPT_LEN prompt and up to MAX_COMPLETION completion tokens."""

    def __init__(self, seed: int, n_seqs: int = 6, empty_seqs: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        b, length = n_seqs, PROMPT_LEN + MAX_COMPLETION
        self.comp_lens = torch.randint(1, MAX_COMPLETION + 1, (b,), generator=g)
        self.comp_lens[0] = MAX_COMPLETION  # at least one full-length completion ...
        self.comp_lens[1] = min(int(self.comp_lens[1]), MAX_COMPLETION - 2)  # ... and one padded
        cols = torch.arange(MAX_COMPLETION)
        self.completion_mask = (cols[None, :] < self.comp_lens[:, None]).long()
        # A tool mask (multi-turn: tool outputs are not trained) makes mask != completion_mask.
        self.tool_mask = (torch.rand(b, MAX_COMPLETION, generator=g) > 0.25).long()
        self.tool_mask[:, 0] = 1
        self.tool_mask[b - empty_seqs :] = 0  # fully masked, e.g. TRL's mask_truncated_completions
        self.mask = self.completion_mask * self.tool_mask
        self.tokens = torch.randint(1, VOCAB, (b, length), generator=g)
        self.tokens[:, PROMPT_LEN:] *= self.completion_mask  # right padding with pad id 0
        self.logits = torch.randn(b, length - 1, VOCAB, generator=g, dtype=torch.float64) * 2
        with torch.no_grad():
            logp = self.logprobs(self.logits)[:, PROMPT_LEN:]
        # The old policy is a perturbation of the current one, so ratios straddle both clip bounds.
        noise = torch.randn(b, MAX_COMPLETION, generator=g, dtype=torch.float64) * 0.35
        self.old_logprobs = (logp + noise) * self.completion_mask
        self.advantages = torch.randn(b, generator=g, dtype=torch.float64)

    def logprobs(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, L] log-prob of each token given its prefix; 0 at position 0."""
        logp = torch.log_softmax(logits, dim=-1).gather(-1, self.tokens[:, 1:, None]).squeeze(-1)
        return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)

    def trl_loss(self, args: TRLGRPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits.clone().requires_grad_(True)
        trl = _TRLGRPO(args, _FusedHeadModel(logits))
        b = len(self.comp_lens)
        inputs = {
            "prompt_ids": self.tokens[:, :PROMPT_LEN],
            "prompt_mask": torch.ones(b, PROMPT_LEN, dtype=torch.long),
            "completion_ids": self.tokens[:, PROMPT_LEN:],
            "completion_mask": self.completion_mask,
            "tool_mask": self.tool_mask,
            "advantages": self.advantages,
            "old_per_token_logps": self.old_logprobs,
            "num_items_in_batch": self.mask.sum(),
        }
        loss = trl._compute_loss(trl.model, inputs)
        (grad,) = torch.autograd.grad(loss, logits)
        return loss.detach(), grad

    def packed(self) -> PackedBatch:
        """The same batch the way Miles sees it: unpadded sequences, concatenated."""
        lens = (PROMPT_LEN + self.comp_lens).numpy()
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        loss_mask = np.concatenate(
            [
                np.concatenate([np.zeros(PROMPT_LEN), self.mask[i, : self.comp_lens[i]].numpy()])
                for i in range(len(lens))
            ]
        ).astype(np.float32)
        n = len(lens)
        return PackedBatch(
            tokens=self._flat(self.tokens).numpy(),
            offsets=offsets,
            prompt_lens=np.full(n, PROMPT_LEN, dtype=np.int64),
            loss_mask=loss_mask,
            rollout_logprobs=np.zeros(len(loss_mask), dtype=np.float32),
            advantages=np.zeros(len(loss_mask), dtype=np.float32),
            rewards=np.zeros(n, dtype=np.float32),
            sample_ids=np.arange(n, dtype=np.int64),
            group_ids=np.arange(n, dtype=np.int64),
        )

    def _flat(self, per_position: torch.Tensor) -> torch.Tensor:
        """[B, L] -> [tokens]: each row cut to its real length, rows concatenated."""
        return torch.cat(
            [
                row[: PROMPT_LEN + int(n)]
                for row, n in zip(per_position, self.comp_lens, strict=True)
            ]
        )

    def miles_loss(
        self, loss_fn: PolicyLoss, aggregation: Aggregation, seq_sum_normalizer: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.packed()
        weights = torch.from_numpy(loss_weights(batch, aggregation, seq_sum_normalizer)).double()
        seq = torch.from_numpy(token_seq_index(batch))
        mask = torch.from_numpy(batch.loss_mask).double()
        old = torch.cat([torch.zeros(len(self.comp_lens), PROMPT_LEN), self.old_logprobs], dim=1)
        logits = self.logits.clone().requires_grad_(True)
        logprobs = self._flat(self.logprobs(logits))
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=self._flat(old),
            rollout_logprobs=self._flat(old),
            advantages=self.advantages[seq] * mask,
            loss_mask=mask,
            loss_weights=weights,
            entropy=torch.zeros_like(mask),
            seq_index=seq,
        )
        per_token, _ = loss_fn(inputs)
        loss = (per_token * weights).sum()
        (grad,) = torch.autograd.grad(loss, logits)
        return loss.detach(), grad

    def _log_ratio(self) -> torch.Tensor:
        return self.logprobs(self.logits)[:, PROMPT_LEN:] - self.old_logprobs

    def ratio(self) -> torch.Tensor:
        """Per-token ratio pi / pi_old on the trained tokens."""
        return torch.exp(self._log_ratio())[self.mask.bool()]

    def token_advantages(self) -> torch.Tensor:
        """Each trained token's advantage, aligned with `ratio()`."""
        return self.advantages[:, None].expand_as(self.mask)[self.mask.bool()]

    def seq_ratio(self) -> torch.Tensor:
        """GSPO's per-sequence ratio: exp of the mean log-ratio over the trained tokens."""
        return torch.exp((self._log_ratio() * self.mask).sum(1) / self.mask.sum(1))


def assert_same(
    miles: tuple[torch.Tensor, torch.Tensor], trl: tuple[torch.Tensor, torch.Tensor]
) -> None:
    torch.testing.assert_close(miles[0], trl[0], **TOL)
    torch.testing.assert_close(miles[1], trl[1], **TOL)
    assert trl[1].abs().max() > 1e-3  # a gradient that is all zero would compare equal vacuously


def assert_clips_both_ways(case: Case, low: float, high: float) -> None:
    """Guards against a vacuous comparison: some ratios must be clipped on each side, some not."""
    r = case.ratio()
    assert (r < 1 - low).any() and (r > 1 + high).any() and ((r > 1 - low) & (r < 1 + high)).any()


# --- losses ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_is_ppo_clip_with_seq_mean_token_mean(seed: int) -> None:
    case = Case(seed)
    assert_clips_both_ways(case, 0.2, 0.2)
    trl = case.trl_loss(_trl_args(loss_type="grpo", epsilon=0.2))
    miles = case.miles_loss(PPOClipLoss(PPOClipConfig(0.2, 0.2)), "seq_mean_token_mean")
    assert_same(miles, trl)


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_is_ppo_clip_with_seq_mean_token_sum_over_max_length(seed: int) -> None:
    case = Case(seed)
    trl = case.trl_loss(_trl_args(loss_type="dr_grpo", epsilon=0.2))
    miles = case.miles_loss(
        PPOClipLoss(PPOClipConfig(0.2, 0.2)),
        "seq_mean_token_sum",
        seq_sum_normalizer=MAX_COMPLETION,
    )
    assert_same(miles, trl)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_dapo_is_clip_higher_with_token_mean(seed: int, loss_type: str) -> None:
    case = Case(seed)
    assert_clips_both_ways(case, 0.2, 0.28)
    trl = case.trl_loss(_trl_args(loss_type=loss_type, epsilon=0.2, epsilon_high=0.28))
    miles = case.miles_loss(PPOClipLoss(PPOClipConfig(0.2, 0.28)), "token_mean")
    assert_same(miles, trl)


@pytest.mark.parametrize("seed", SEEDS)
def test_trl_delta_is_dual_clip(seed: int) -> None:
    # TRL's `delta` caps the unclipped ratio for every token; with delta > 1 + eps_high that only
    # binds for negative advantages, which is exactly dual-clip PPO's -A * c floor.
    case = Case(seed, n_seqs=16)  # enough tokens for ratios past delta with either sign of A
    assert ((case.ratio() > 1.5) & (case.token_advantages() < 0)).any()
    assert ((case.ratio() > 1.5) & (case.token_advantages() > 0)).any()  # where it must not bind
    trl = case.trl_loss(_trl_args(loss_type="dapo", epsilon=0.2, epsilon_high=0.28, delta=1.5))
    miles = case.miles_loss(PPOClipLoss(PPOClipConfig(0.2, 0.28, dual_clip=1.5)), "token_mean")
    assert_same(miles, trl)


@pytest.mark.parametrize("seed", SEEDS)
def test_cispo_matches_trl(seed: int) -> None:
    # TRL's epsilon_high is the ratio cap itself (docs: "5.0"), Miles' is the excess over 1.
    case = Case(seed)
    assert (case.ratio() > 1.25).any()
    trl = case.trl_loss(_trl_args(loss_type="cispo", epsilon_high=1.25))
    miles = case.miles_loss(CISPOLoss(CISPOConfig(clip_high=0.25)), "token_mean")
    assert_same(miles, trl)


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_is_trl_sequence_level_grpo(seed: int) -> None:
    # TRL's GSPO is loss_type="grpo" with a sequence-level ratio: exp(mean masked log-ratio),
    # clipped per sequence, gradient through the mean; Miles' GSPO-token form equals it for a
    # sequence-constant advantage.
    case = Case(seed)
    s = case.seq_ratio()
    assert ((s < 0.97) | (s > 1.03)).any() and ((s > 0.97) & (s < 1.03)).any()
    trl = case.trl_loss(
        _trl_args(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.03)
    )
    miles = case.miles_loss(GSPOLoss(GSPOConfig(0.03, 0.03)), "seq_mean_token_mean")
    assert_same(miles, trl)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_fully_masked_sequences_count_like_trl(loss_type: str) -> None:
    # Per-sequence aggregations divide by the batch size B, counting sequences with no trained
    # token (truncated completions under mask_truncated_completions, or all-tool turns), as TRL does.
    case = Case(0, empty_seqs=2)
    b, trained = len(case.comp_lens), int((case.mask.sum(1) > 0).sum())
    assert trained == b - 2
    trl = case.trl_loss(_trl_args(loss_type=loss_type, epsilon=0.2))
    if loss_type == "grpo":
        miles = case.miles_loss(PPOClipLoss(PPOClipConfig()), "seq_mean_token_mean")
    else:
        miles = case.miles_loss(PPOClipLoss(PPOClipConfig()), "seq_mean_token_sum", MAX_COMPLETION)
    assert_same(miles, trl)
    # Token-level aggregation does not count sequences, so it agrees with empty sequences too.
    trl_dapo = case.trl_loss(_trl_args(loss_type="dapo", epsilon=0.2))
    assert_same(case.miles_loss(PPOClipLoss(PPOClipConfig()), "token_mean"), trl_dapo)


# --- advantages -----------------------------------------------------------------------------------


def _rewards(seed: int, n_groups: int, group_size: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    r = rng.integers(0, 2, size=(n_groups, group_size)).astype(np.float64)  # verifier-style 0/1
    r[0] = rng.normal(size=group_size)  # a continuous group
    r[1] = 1.0  # a group with no reward variance
    return r.reshape(-1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("scale_rewards", "config"),
    [
        ("group", GRPOConfig(normalize_std=True, eps=TRL_ADV_EPS)),
        ("none", GRPOConfig(normalize_std=False)),
    ],
)
def test_grpo_advantage_matches_trl(seed: int, scale_rewards: str, config: GRPOConfig) -> None:
    n_groups, group_size = 5, 4
    rewards = _rewards(seed, n_groups, group_size)
    args = _trl_args(num_generations=group_size, scale_rewards=scale_rewards)
    expected = trl_advantages(_TRLGRPO(args, _scoring_model(len(rewards))), rewards)
    got = _shuffled(GRPOAdvantage(config), rewards, n_groups, group_size, seed)
    np.testing.assert_allclose(got, expected, **TOL)
    assert np.abs(expected).max() > 0.1


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_advantage_matches_trl(seed: int) -> None:
    # TRL's RLOOTrainer with normalize_advantages=False (its default) and no reward clipping.
    n_groups, group_size = 5, 4
    rewards = _rewards(seed, n_groups, group_size)
    # One scoring chunk: the stand-in model answers for the whole batch at once.
    args = _trl_args(
        TRLRLOOConfig, num_generations=group_size, per_device_train_batch_size=len(rewards)
    )
    expected = trl_advantages(_TRLRLOO(args, _scoring_model(len(rewards))), rewards)
    got = _shuffled(RLOOAdvantage(RLOOConfig()), rewards, n_groups, group_size, seed)
    np.testing.assert_allclose(got, expected, **TOL)
    assert np.abs(expected).max() > 0.1


def _shuffled(
    estimator: Any, rewards: np.ndarray, n_groups: int, size: int, seed: int
) -> np.ndarray:
    """Miles' advantages in TRL's order, computed on a shuffled batch.

    TRL needs each group contiguous and equal-sized; Miles takes group ids, so shuffle the order.
    """
    perm = np.random.default_rng(seed + 100).permutation(len(rewards))
    group_ids = np.repeat(np.arange(n_groups), size)
    out = np.empty(len(rewards))
    out[perm] = estimator(rewards[perm], group_ids[perm])
    return out


def test_grpo_advantage_default_eps_differs_from_trl() -> None:
    # Miles' default eps (1e-6) is not TRL's 1e-4: same direction, slightly larger magnitude.
    rewards = np.array([0.0, 0.0, 1.0, 1.0])
    args = _trl_args(num_generations=4, scale_rewards="group")
    trl = trl_advantages(_TRLGRPO(args, _scoring_model(4)), rewards)
    miles = GRPOAdvantage(GRPOConfig())(rewards, np.zeros(4, dtype=np.int64))
    assert not np.allclose(miles, trl, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(miles, trl, rtol=2e-4)
