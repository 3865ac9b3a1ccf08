"""When a response ends, decided on the host after each sampled token (both generation loops),
and the argument checks of the sampling fields the engine reads on the host."""

from __future__ import annotations

import re
from typing import Any

from miles.core.contracts.types import GenerateRequest
from miles.torch.engine.logits import RowState

# The most top logprobs a request may ask for (OpenAI's and vLLM's default bound).
MAX_TOP_LOGPROBS = 20


def check_request(request: GenerateRequest, vocab: int | None = None) -> None:
    """ValueError for sampling fields the engine cannot honour (`vocab`: the model's vocabulary
    size, which logit_bias's token ids must be below; None: not checked)."""
    sampling = request.sampling
    if vocab is not None:
        outside = [token for token, _ in sampling.logit_bias if not 0 <= token < vocab]
        if outside:
            raise ValueError(
                f"request {request.request_id}: logit_bias token id {outside[0]} is outside the "
                f"vocabulary [0, {vocab})"
            )
    if sampling.top_logprobs > MAX_TOP_LOGPROBS:
        raise ValueError(
            f"request {request.request_id}: top_logprobs must be at most {MAX_TOP_LOGPROBS}, "
            f"got {sampling.top_logprobs}"
        )
    for pattern in sampling.stop_regex:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"request {request.request_id}: stop_regex {pattern!r} is not a valid regular "
                f"expression: {e}"
            ) from e


class StopChecker:
    """Called once per token appended to a response, in order: the row's constraint (if any)
    accepts the token, then the finish reason, if the token ends the response.

    "stop": a model end-of-sequence id (unless the request has ignore_eos), one of the request's
    stop_token_ids, a stop string in the text, a stop_regex match anywhere in the response's text
    or a finished constraint; else "length" at max_new_tokens. The stopping token stays in the
    response.
    """

    def __init__(self, eos_ids: frozenset[int], tokenizer: Any) -> None:
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer

    def __call__(self, row: RowState) -> str | None:
        sampling = row.request.sampling
        token = row.response[-1]
        if sampling.constraint is not None:
            sampling.constraint.accept(token)
        if token in sampling.stop_token_ids or (token in self.eos_ids and not sampling.ignore_eos):
            return "stop"
        if sampling.stop_strings and self._hits_stop_string(row.response, sampling.stop_strings):
            return "stop"
        if sampling.stop_regex:
            # A regex match may begin anywhere (and lookarounds see any context): the whole text.
            text = self.tokenizer.decode(row.response)
            if any(re.search(pattern, text) for pattern in sampling.stop_regex):
                return "stop"
        if sampling.constraint is not None and sampling.constraint.is_finished():
            return "stop"
        if len(row.response) >= sampling.max_new_tokens:
            return "length"
        return None

    def _hits_stop_string(self, response: list[int], stop_strings: tuple[str, ...]) -> bool:
        # A new match must end in the newest token. Every token decodes to at least one byte, so a
        # match of n bytes lies within the last n + 1 tokens (+1 for a token it starts inside).
        window = max(len(s.encode()) for s in stop_strings) + 2
        tail = self.tokenizer.decode(response[-window:])
        return any(s in tail for s in stop_strings)
