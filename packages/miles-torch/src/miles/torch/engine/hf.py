"""The hf generation loop's steps: transformers' model forward with its own cache, continuous
batching by rows.

Each step either prefills newly admitted prompts (left-padded, one forward) or runs one decode
step over every row. A row's result is yielded as soon as it finishes; finished rows are dropped
in bulk and their slots go to waiting prompts, so long generations do not hold short ones back.
Sampling and logprobs live in `sampler` (and `logits`), the cache bookkeeping in `batch`.

Models whose cache cannot be left-padded (sliding windows, compressed-window attention: see
`batch.batching_mode`) run unpadded instead: prompts of equal length are admitted together as
one batch, and each such batch decodes with its own forward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from miles.core.contracts.types import GenerateRequest, GenerateResult
from miles.torch.engine.batch import Batch, Row
from miles.torch.engine.logits import (
    LogitsProcessor,
    add_prompt_logprobs,
    result_fields,
    sample_rows,
    take,
)
from miles.torch.engine.sampler import SamplingTensors
from miles.torch.routing import RoutingRecorder


def _rows(weights: torch.Tensor | None, i: int, width: int, n: int) -> torch.Tensor | None:
    if weights is None:
        return None
    return weights.view(-1, width, *weights.shape[1:])[i, width - n :]


class HFLoop:
    """Steps of the hf path over `TorchRolloutEngine`'s model; the engine drives them (and
    pauses) and holds the lock."""

    def __init__(
        self,
        model: Any,
        *,
        max_batch_size: int,
        padded: bool,
        generator: torch.Generator,
        finish_reason: Callable[[Row], str | None],
        pad_id: int,
        cache_kwarg: str,
        routing_dtype: np.dtype[Any],
        constraint_vocab: int,
        weight_version: Callable[[], int],
    ) -> None:
        self.model = model
        self.device = model.device
        self.max_batch_size = max_batch_size
        self.padded = padded
        self.generator = generator
        self.finish_reason = finish_reason  # once per appended token (`stops.StopChecker`)
        self.pad_id = pad_id
        self.cache_kwarg = cache_kwarg
        self.routing_dtype = routing_dtype
        self.constraint_vocab = constraint_vocab
        self.weight_version = weight_version
        self.recorder: RoutingRecorder | None = None  # hooks on the routers, when recording

    def step(
        self, batches: list[Batch], pending: deque[GenerateRequest]
    ) -> tuple[list[Batch], list[GenerateResult]]:
        """Prefill newly admitted prompts if there is room, else decode one token for every row."""
        free = self.max_batch_size - sum(len(batch) for batch in batches)
        if pending and free > 0:
            step, logits = self._prefill(self._admit(pending, free))
            finished = self._advance(step, logits)
            step.compact()  # a fresh prefill batch is small: compact now
            if len(step):
                if self.padded and batches:
                    batches[0].merge(step)
                else:
                    batches.append(step)
            return batches, finished
        finished = []
        for batch in batches:
            finished += self._advance(batch, self._decode(batch))
            # Dropping rows copies the whole cache, so finished rows ride along (their tokens
            # ignored) until a quarter of the batch is done; then one copy drops them all and
            # the freed slots are refilled in one prefill.
            if 4 * batch.num_done >= len(batch):
                batch.compact()
        return [batch for batch in batches if len(batch)], finished

    def _admit(self, pending: deque[GenerateRequest], free: int) -> list[GenerateRequest]:
        """The next prompts to prefill together: the first `free` (unpadded: the first `free` of
        the head's prompt length, so that the batch needs no padding)."""
        if self.padded:
            return [pending.popleft() for _ in range(min(free, len(pending)))]
        n = len(pending[0].prompt_ids)
        taken = [r for r in pending if len(r.prompt_ids) == n][:free]
        chosen = {id(r) for r in taken}
        rest = [r for r in pending if id(r) not in chosen]
        pending.clear()
        pending.extend(rest)
        return taken

    def _advance(self, step: Batch, logits: torch.Tensor) -> list[GenerateResult]:
        """Sample each row's next token from `logits`; the results of the rows that finish."""
        params = step.params
        counters = None
        if params.seeded:
            lengths = [len(row.response) for row in step.rows]
            counters = torch.tensor(lengths, device=self.device)
        assert step.processor is not None
        step.last_tokens, packed = sample_rows(
            logits, step.rows, params, step.processor, self.generator, counters
        )
        drawn = packed.cpu().numpy()  # one transfer, one wait
        finished = []
        for j, row in enumerate(step.rows):
            if row.done:
                continue
            if not row.request.sampling.max_new_tokens:  # ran for its prompt logprobs only
                row.done = True
                finished.append(self.result(row, "length"))
                continue
            take(row, drawn, j)
            reason = self.finish_reason(row)
            if reason is not None:
                row.done = True
                finished.append(self.result(row, reason))
        return finished

    def _prefill(self, requests: list[GenerateRequest]) -> tuple[Batch, torch.Tensor]:
        """Run the prompts through the model as one left-padded batch; last-position logits (and
        the prompt logprobs of the requests that asked: then every position's logits)."""
        width = max(len(r.prompt_ids) for r in requests)
        row_records: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(requests), width), dtype=torch.int64)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Real tokens get positions 0..n-1 whatever their padding; pads get 0 (they are masked).
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        every = any(r.sampling.prompt_logprobs for r in requests)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=0 if every else 1,
            **{self.cache_kwarg: cache},
        )
        if self.recorder is not None:  # every prompt token's experts (left padding dropped)
            indices, weights = self.recorder.take()
            indices = indices.view(len(requests), width, *indices.shape[1:])
            for i, r in enumerate(requests):
                n = len(r.prompt_ids)
                row_records.append((indices[i, width - n :], _rows(weights, i, width, n)))
        rows = [Row(r) for r in requests]
        for i, row in enumerate(rows):
            if row.request.sampling.prompt_logprobs:
                n = len(row.request.prompt_ids)
                add_prompt_logprobs(row, out.logits[i, width - n : width - 1], 0)
        for row, (idx, w) in zip(rows, row_records, strict=False):
            row.routing.append(idx)
            if w is not None:
                row.routing_weights.append(w)
        batch = Batch(
            rows=rows,
            cache=cache,
            mask=mask,
            positions=mask.sum(dim=1),
            last_tokens=ids[:, -1],
            params=SamplingTensors.from_params([r.sampling for r in requests], self.device),
            padded=self.padded,
            processor=LogitsProcessor(self.constraint_vocab),
        )
        return batch, out.logits[:, -1]

    def _decode(self, batch: Batch) -> torch.Tensor:
        """Feed each row its last sampled token; next-token logits [rows, vocab]."""
        ones = torch.ones((len(batch), 1), dtype=batch.mask.dtype, device=self.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        out = self.model(
            input_ids=batch.last_tokens.unsqueeze(1),
            attention_mask=batch.mask,
            position_ids=batch.positions.unsqueeze(1),
            use_cache=True,
            **{self.cache_kwarg: batch.cache},
        )
        if self.recorder is not None:  # each row's newest token
            indices, weights = self.recorder.take()
            for i, row in enumerate(batch.rows):
                row.routing.append(indices[i : i + 1])
                if weights is not None:
                    row.routing_weights.append(weights[i : i + 1])
        batch.positions = batch.positions + 1
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def result(self, row: Row, reason: str) -> GenerateResult:
        routing = weights = None
        if self.recorder is not None and row.routing:
            # The last sampled token was never fed through the model: its row stays -1.
            n = len(row.request.prompt_ids) + len(row.response)
            routing = np.full((n, *row.routing[0].shape[1:]), -1, dtype=self.routing_dtype)
            fed = torch.cat(row.routing).cpu().numpy()
            routing[: len(fed)] = fed[:n]
            if row.routing_weights:
                weights = np.zeros(routing.shape, dtype=np.float32)
                fed_w = torch.cat(row.routing_weights).cpu().numpy()
                weights[: len(fed_w)] = fed_w[:n]
        return GenerateResult(
            request_id=row.request.request_id,
            response_ids=row.response,
            logprobs=row.logprobs,
            finish_reason=reason,
            weight_version=self.weight_version(),
            routing=routing,
            routing_weights=weights,
            **result_fields(row),
        )
