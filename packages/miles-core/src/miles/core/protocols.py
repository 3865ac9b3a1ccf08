"""The small protocols that backends and algorithm plugins implement.

Each is a handful of methods. Core code talks only to these, so a native torch engine, SGLang, an
FSDP2 trainer or Megatron fit behind the same calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from miles.core.types import GenerateRequest, GenerateResult, PackedBatch, Sample, SamplingParams

if TYPE_CHECKING:
    import torch


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates responses for token-id prompts and takes new weights from the trainer."""

    @property
    def weight_version(self) -> int: ...

    def generate(self, requests: list[GenerateRequest]) -> Iterator[GenerateResult]:
        """Yields each result as soon as its sequence finishes (a stream, not a batch)."""
        ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None
    ) -> None:
        """Copies the given tensors into the model (Hugging Face names) and sets the version
        (None: keeps it, for one part of a load that arrives in several)."""
        ...

    def set_weight_version(self, version: int) -> None: ...

    def weights_checksum(self) -> str: ...

    def pause(self) -> None:
        """A running `generate` stops at its next step and yields every unfinished request with
        finish_reason "abort" and its tokens so far."""
        ...

    def resume(self) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def health(self) -> dict[str, Any]:
        """At least {"ok": bool, "paused": bool}."""
        ...

    def get_rng_state(self) -> str:
        """The sampling RNG's state, as text (it goes into checkpoints' JSON)."""
        ...

    def set_rng_state(self, state: str) -> None: ...


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


class TrainBackend(Protocol):
    """One rank of a training group."""

    def logprobs(self, batch: PackedBatch) -> dict[str, Any]: ...

    def train_step(self, batch: PackedBatch, loss: PolicyLoss) -> dict[str, float]: ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]: ...

    def save(self, path: str) -> None: ...

    def load(self, path: str) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...


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
    def tokenizer(self) -> Any: ...

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
