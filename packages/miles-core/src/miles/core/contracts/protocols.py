"""The protocols that algorithm and rollout components implement: every call the runtime makes,
typed (the backends' are in `miles.core.contracts.backends`).

Each is a handful of methods. Optional abilities are declared as `Capability` members in the
component's spec, never probed with hasattr: a component that declares one implements the
matching extended protocol here (e.g. `oversamples` -> `OversamplingFilter`). Tensors are torch
tensors, named only for type checkers: miles-core itself never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from miles.core.contracts.types import GenerateRequest, GenerateResult, Sample, SamplingParams

if TYPE_CHECKING:
    import torch

F32 = npt.NDArray[np.float32]


# ── algorithm ────────────────────────────────────────────────────────────────────────────────────


@dataclass
class LossInputs:
    """Flat per-token tensors for one micro-batch; every tensor has shape [tokens].

    `loss_weights` already folds in the loss mask and the aggregation (token mean, sequence mean,
    ...) over the *global* batch, so the micro-batch loss is `(per_token_loss * loss_weights).sum()`
    and summing micro-batches and ranks gives exactly the one-shot value.
    """

    logprobs: torch.Tensor  # current policy; carries the gradient
    old_logprobs: torch.Tensor  # the policy that generated the data, as seen by the trainer
    rollout_logprobs: torch.Tensor  # as reported by the rollout engine
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    loss_weights: torch.Tensor
    entropy: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    seq_index: torch.Tensor | None = None  # which sequence of the micro-batch each token belongs to
    # For a value (critic) loss: the critic's current values (carry the gradient), its values when
    # the data was scored, and the return targets (e.g. from GAE).
    values: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


class PolicyLoss(Protocol):
    """A loss plugin: per-token loss plus per-token metrics, both [tokens].

    The trainer reduces both with `loss_weights`, so metrics aggregate like the loss does.
    """

    def __call__(self, inputs: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class AdvantageEstimator(Protocol):
    """Per-sample rewards of the whole step to per-sample advantages."""

    def __call__(self, rewards: F32, group_ids: npt.NDArray[np.int64]) -> F32: ...


class TokenAdvantageEstimator(Protocol):
    """An estimator that declares `Capability.NEEDS_VALUES`: per-token advantages and return
    targets from a critic's values."""

    def token_advantages(
        self,
        rewards: F32,
        values: F32,
        offsets: npt.NDArray[np.int64],
        mask: F32,
        token_penalty: npt.NDArray[np.floating[Any]] | None = None,
    ) -> tuple[F32, F32]: ...


class KLEstimator(Protocol):
    """Per-token KL(pi || pi_ref) from (logprobs, ref_logprobs): torch tensors inside a loss
    (differentiable), numpy arrays for a reward penalty; the result has the input's type."""

    def __call__(self, logprobs: Any, ref_logprobs: Any) -> Any: ...


class Correction(Protocol):
    """A train-inference mismatch correction over numpy arrays [tokens]: (importance weights,
    keep mask, scalar metrics) from trainer and rollout logprobs."""

    def __call__(
        self,
        old_logprobs: F32,
        rollout_logprobs: F32,
        loss_mask: F32,
        seq_index: npt.NDArray[np.int64],
    ) -> tuple[F32, F32, dict[str, float]]: ...


# ── rollout side ─────────────────────────────────────────────────────────────────────────────────


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the rollout side uses (a plugin loads it through
    the `miles_load_tokenizer` hook)."""

    eos_token_id: int | None

    def __call__(self, texts: list[str], *, add_special_tokens: bool) -> Any:
        """{"input_ids": list of token-id lists}."""
        ...

    def apply_chat_template(
        self, conversations: list[list[dict[str, str]]], **kwargs: Any
    ) -> Any: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class Reward(Protocol):
    """Scores one finished sample from its decoded response."""

    async def __call__(self, response: str, sample: Sample) -> float: ...


class GroupReward(Protocol):
    """A reward that declares `Capability.SCORES_GROUPS`: one call per group (batched models)."""

    async def score_group(self, responses: list[str], samples: list[Sample]) -> list[float]: ...


class SampleFilter(Protocol):
    """Keeps some samples of one group (none: the group is dropped)."""

    def __call__(self, group: list[Sample]) -> list[Sample]: ...


class OversamplingFilter(SampleFilter, Protocol):
    """A filter that declares `Capability.OVERSAMPLES`: it may drop whole groups, and the step
    draws more prompts to refill them, up to this many extra rounds."""

    @property
    def oversample_rounds(self) -> int: ...


class MetricSink(Protocol):
    """Receives each step's metrics (factory(run_dir) builds it)."""

    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


@dataclass
class PromptGroup:
    """One prompt, tokenized once, and the ids of the samples to generate for it."""

    group_id: int
    prompt_ids: list[int]
    row: dict[str, Any]  # the data row: reference answers, test cases, ...
    sample_ids: list[int]


class RolloutContext(Protocol):
    """What a rollout function may use: the engines, the tokenizer, the sampling defaults."""

    @property
    def sampling(self) -> SamplingParams: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Results in request order. Requests from concurrent calls are batched together."""
        ...


class RolloutFunction(Protocol):
    """How one group is generated: single-turn, multi-turn with tools, agentic."""

    async def __call__(self, ctx: RolloutContext, group: PromptGroup) -> list[Sample]: ...


@dataclass
class EnvStep:
    """What an environment returns from `reset` and `step`."""

    observation: str  # text for the model to read next (tool output); may be empty
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    """A multi-turn environment over text: tools, games, code execution.

    One instance serves one episode (one sample); the rollout function builds a fresh one each time.
    """

    async def reset(self, row: dict[str, Any]) -> EnvStep: ...

    async def step(self, action: str) -> EnvStep: ...
