"""A request's state in the paged engine: its tokens, its pages and how many are computed."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt

from miles.core.contracts.types import GenerateRequest


class Status(Enum):
    WAITING = "waiting"  # not in the cache (new, or preempted: recomputed when admitted again)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request: GenerateRequest
    order: int  # admission order within this engine: preemption takes the newest first
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # page ids holding tokens[0 : len(pages) * P]
    num_computed: int = 0  # tokens whose K/V are in the cache
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # MoE routing record [tokens, moe_layers, top_k] (and gate weights), set when it finishes.
    routing: npt.NDArray[np.integer[Any]] | None = None
    routing_weights: npt.NDArray[np.float32] | None = None
    # What the request asked for beyond logprobs (see `engine.logits`).
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.response

    def __len__(self) -> int:
        return len(self.request.prompt_ids) + len(self.response)

    @property
    def done(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and has not all of them yet: its prompt positions must be
        computed, none taken from the prefix cache."""
        wanted = len(self.request.prompt_ids) - 1
        return self.request.sampling.prompt_logprobs and len(self.prompt_logprobs) < wanted

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed through the model: the prompt (or what a preemption dropped),
        else the last sampled token."""
        return len(self) - self.num_computed
