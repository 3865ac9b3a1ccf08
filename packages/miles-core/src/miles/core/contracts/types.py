"""The data that flows through one RL step.

Tokens in, tokens out: a `Sample` carries token ids from the rollout engine to the trainer, and
nothing between them ever re-tokenizes text. Across actors, samples travel packed as a few large
numpy arrays (`PackedBatch`), not as many Python objects.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt


class SampleStatus(enum.StrEnum):
    COMPLETED = "completed"  # the engine hit a stop token or stop string
    TRUNCATED = "truncated"  # the engine hit max_new_tokens
    ABORTED = "aborted"  # generation was cut short (weight update, shutdown)
    FAILED = "failed"  # generation or reward raised; `Sample.error` says why


@dataclass
class Sample:
    """One prompt and one sampled response, with everything training needs."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    # 1 where the token is trained on, 0 for tool or environment output. Defaults to all ones.
    loss_mask: list[int] | None = None
    reward: float | None = None
    group_id: int = 0
    sample_id: int = 0
    # The weight version the response was generated with; a list (one per response token) when a
    # partial rollout spans a weight update.
    weight_version: int | list[int] = 0
    status: SampleStatus = SampleStatus.COMPLETED
    error: str | None = None
    # MoE routing record: top-k expert ids, [tokens, moe_layers, top_k], smallest int dtype that fits.
    routing: npt.NDArray[np.integer[Any]] | None = None
    routing_weights: npt.NDArray[np.floating[Any]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def effective_loss_mask(self) -> list[int]:
        if self.loss_mask is None:
            return [1] * len(self.response_ids)
        if len(self.loss_mask) != len(self.response_ids):
            raise ValueError(
                f"sample {self.sample_id}: loss_mask has {len(self.loss_mask)} entries "
                f"for {len(self.response_ids)} response tokens"
            )
        return self.loss_mask


@dataclass(frozen=True)
class SamplingParams:
    """How the engine samples. Logprobs are always those of log_softmax(logits / temperature)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    min_p: float = 0.0  # 0: off
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    # None: the engine's generator. A seed makes the request's tokens depend only on the seed,
    # the weights and the prompt, not on what it is batched with (SGLang's sampling_seed).
    seed: int | None = None
    # Generate past the model's end-of-sequence tokens (stop_token_ids still stop).
    ignore_eos: bool = False
    # Penalties on tokens already generated (OpenAI's frequency/presence, the CTRL-style
    # repetition penalty over prompt and response); the defaults change nothing.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Stop once the response's text matches one of these regular expressions (SGLang's stop_regex).
    stop_regex: tuple[str, ...] = ()
    # OpenAI's and SGLang's logit_bias: (token id, bias) pairs, each bias added to its token's
    # logit before sampling (after penalties and a constraint's mask), so the response's logprobs
    # are those of the biased distribution, as SGLang's are.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # The k most likely tokens and their logprobs at each response position (0: none).
    top_logprobs: int = 0
    # Also the logprob of each prompt token after the first, given the tokens before it (and its
    # top_logprobs): SGLang's input_token_logprobs, OpenAI's echo, /v1/score. Raw, unlike the
    # response's: log_softmax(logits) at temperature 1, without penalties or constraint.
    prompt_logprobs: bool = False
    # Structured output: which tokens may come next (None: any). Stateful, one per request, so it
    # is never shared between requests and never compared.
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"sampling seed must be in [0, 2**63), got {self.seed}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        for token, bias in self.logit_bias:
            if token < 0 or not math.isfinite(bias):
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and finite biases, got {token}: {bias}"
                )

    @property
    def penalized(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class TokenConstraint(Protocol):
    """A grammar over one request's response tokens (structured output: JSON schema, regex,
    EBNF). The engine asks for the allowed next tokens before each sampling step, masks the rest
    (the logprobs are those of the masked distribution, as sampled), and reports the token it
    sampled. Called from the engine's thread only."""

    def fill_bitmask(self, bitmask: npt.NDArray[np.int32], row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` ([rows, ceil(vocab / 32)] int32,
        bit `t % 32` of word `t // 32` set when token t is allowed)."""

    def accept(self, token_id: int) -> None:
        """The engine sampled `token_id`."""

    def is_finished(self) -> bool:
        """The grammar is complete: the response must stop here."""


@dataclass(frozen=True)
class GenerateRequest:
    request_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    # SGLang's cache_salt: requests share cached prefixes only with requests of the same salt
    # (None: the unsalted cache), so one tenant's prompts cannot be probed through another's hits.
    cache_salt: str | None = None


@dataclass
class GenerateResult:
    request_id: int
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    # The weights' version; a list, one per response token, when the request was paused for a
    # weight update and finished with the new weights (a partial rollout).
    weight_version: int | list[int]
    # MoE routing record of prompt + response: [tokens, moe_layers, top_k] (-1: not recorded).
    routing: npt.NDArray[np.integer[Any]] | None = None
    routing_weights: npt.NDArray[np.float32] | None = None
    # Prompt tokens whose KV the engine found cached (a shared or earlier prefix): SGLang's
    # meta_info.cached_tokens.
    cached_tokens: int = 0
    # With SamplingParams.top_logprobs = k: per response token, the k most likely (token id,
    # logprob) pairs, most likely first, from the same distribution as `logprobs`.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # With SamplingParams.prompt_logprobs: prompt tokens 1.. (len - 1 entries), and their top-k.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


def token_versions(version: int | list[int], num_tokens: int) -> list[int]:
    """One weight version per token, whichever form `version` has."""
    if isinstance(version, list):
        if len(version) != num_tokens:
            raise ValueError(f"{len(version)} weight versions for {num_tokens} tokens")
        return list(version)
    return [version] * num_tokens


def oldest_version(version: int | list[int]) -> int:
    """The version the oldest token came from (what staleness is measured by)."""
    if isinstance(version, list):
        return min(version) if version else 0
    return int(version)


@dataclass
class PackedBatch:
    """Samples concatenated into flat arrays: what crosses an actor boundary.

    Sequence i occupies tokens[offsets[i]:offsets[i+1]]; its first prompt_lens[i] tokens are the
    prompt. Per-token arrays (loss_mask, rollout_logprobs, advantages) are aligned with `tokens`, and
    hold 0 on prompt tokens.

    The optional per-token arrays are filled in by the train step's caller: `old_logprobs` and
    `ref_logprobs` as recomputed by the trainer, `loss_weights` (see `LossInputs`), which fold
    the loss mask and the aggregation over the whole batch, and for a critic (PPO with GAE) the
    critic's `values` when the data was scored and the `returns` it is trained towards.
    """

    tokens: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    prompt_lens: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.float32]
    rollout_logprobs: npt.NDArray[np.float32]
    advantages: npt.NDArray[np.float32]
    rewards: npt.NDArray[np.float32]
    sample_ids: npt.NDArray[np.int64]
    group_ids: npt.NDArray[np.int64]
    old_logprobs: npt.NDArray[np.float32] | None = None
    ref_logprobs: npt.NDArray[np.float32] | None = None
    loss_weights: npt.NDArray[np.float32] | None = None
    values: npt.NDArray[np.float32] | None = None
    returns: npt.NDArray[np.float32] | None = None
    # MoE routing records aligned with `tokens`: [tokens, moe_layers, top_k] expert indices (-1:
    # none) and, when recorded, the gate weights. None when the samples carry no record.
    routing: npt.NDArray[np.integer[Any]] | None = None
    routing_weights: npt.NDArray[np.float32] | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def seq_lens(self) -> npt.NDArray[np.int64]:
        return np.diff(self.offsets)

    @classmethod
    def from_samples(
        cls, samples: list[Sample], advantages: list[float] | None = None
    ) -> PackedBatch:
        """Pack samples; each sample's scalar advantage is spread over its response tokens."""
        lens = [s.num_tokens for s in samples]
        offsets = np.zeros(len(samples) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        total = int(offsets[-1])
        tokens = np.zeros(total, dtype=np.int64)
        mask = np.zeros(total, dtype=np.float32)
        logprobs = np.zeros(total, dtype=np.float32)
        adv = np.zeros(total, dtype=np.float32)
        for i, s in enumerate(samples):
            start, p = int(offsets[i]), len(s.prompt_ids)
            end = int(offsets[i + 1])
            tokens[start : start + p] = s.prompt_ids
            tokens[start + p : end] = s.response_ids
            mask[start + p : end] = s.effective_loss_mask()
            if s.rollout_logprobs:
                logprobs[start + p : end] = s.rollout_logprobs
            if advantages is not None:
                adv[start + p : end] = advantages[i]
        return cls(
            tokens=tokens,
            offsets=offsets,
            prompt_lens=np.array([len(s.prompt_ids) for s in samples], dtype=np.int64),
            loss_mask=mask,
            rollout_logprobs=logprobs,
            advantages=adv,
            rewards=np.array([s.reward or 0.0 for s in samples], dtype=np.float32),
            sample_ids=np.array([s.sample_id for s in samples], dtype=np.int64),
            group_ids=np.array([s.group_id for s in samples], dtype=np.int64),
            routing=_concat_records(samples, "routing", lens),
            routing_weights=_concat_records(samples, "routing_weights", lens),
        )

    def to_samples(self) -> list[Sample]:
        """Unpacks into Sample objects (for lifecycle hooks and tests; training uses arrays)."""
        samples = []
        for i in range(len(self)):
            start, end = int(self.offsets[i]), int(self.offsets[i + 1])
            p = start + int(self.prompt_lens[i])
            samples.append(
                Sample(
                    prompt_ids=self.tokens[start:p].tolist(),
                    response_ids=self.tokens[p:end].tolist(),
                    rollout_logprobs=self.rollout_logprobs[p:end].tolist(),
                    loss_mask=self.loss_mask[p:end].astype(int).tolist(),
                    reward=float(self.rewards[i]),
                    group_id=int(self.group_ids[i]),
                    sample_id=int(self.sample_ids[i]),
                )
            )
        return samples

    def select(self, indices: list[int] | npt.NDArray[np.int64]) -> PackedBatch:
        """A new batch holding the given sequences, in the given order."""
        idx = np.asarray(indices, dtype=np.int64)
        lens = self.seq_lens[idx]
        offsets = np.zeros(len(idx) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        token_idx = (
            np.concatenate([np.arange(self.offsets[i], self.offsets[i + 1]) for i in idx])
            if len(idx)
            else np.zeros(0, dtype=np.int64)
        )
        return PackedBatch(
            tokens=self.tokens[token_idx],
            offsets=offsets,
            prompt_lens=self.prompt_lens[idx],
            loss_mask=self.loss_mask[token_idx],
            rollout_logprobs=self.rollout_logprobs[token_idx],
            advantages=self.advantages[token_idx],
            rewards=self.rewards[idx],
            sample_ids=self.sample_ids[idx],
            group_ids=self.group_ids[idx],
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs[token_idx],
            ref_logprobs=None if self.ref_logprobs is None else self.ref_logprobs[token_idx],
            loss_weights=None if self.loss_weights is None else self.loss_weights[token_idx],
            values=None if self.values is None else self.values[token_idx],
            returns=None if self.returns is None else self.returns[token_idx],
            routing=None if self.routing is None else self.routing[token_idx],
            routing_weights=None
            if self.routing_weights is None
            else self.routing_weights[token_idx],
        )


def _concat_records(samples: list[Sample], name: str, lens: list[int]) -> Any:
    """The samples' routing records (one row per token) as one array; None unless every sample
    has one."""
    records = [getattr(s, name) for s in samples]
    if not samples or any(r is None for r in records):
        return None
    for s, r, n in zip(samples, records, lens, strict=True):
        if len(r) != n:
            raise ValueError(
                f"sample {s.sample_id}: {name} has {len(r)} rows for {n} tokens (prompt + response)"
            )
    return np.concatenate(records)


def split_by_token_budget(
    seq_lens: list[int] | npt.NDArray[np.int64], budget: int
) -> list[list[int]]:
    """Group sequence indices into micro-batches of at most `budget` tokens, keeping order.

    A sequence longer than the budget goes into a micro-batch of its own rather than failing.
    """
    if budget <= 0:
        raise ValueError(f"micro-batch token budget must be positive, got {budget}")
    batches: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(int(x) for x in seq_lens):
        if current and used + n > budget:
            batches.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        batches.append(current)
    return batches


@dataclass(frozen=True)
class RunInfo:
    """What lifecycle hooks learn about the run they observe."""

    run_id: str
    name: str
    run_dir: str
    config: dict[str, Any]
