"""What a request may ask of the logits beyond plain sampling, on both generation loops.

Before sampling (`LogitsProcessor`, only for batches whose host-side flags say a row needs it:
`SamplingTensors.penalized` / `.constrained` / `.biased`; other batches never get here):

- penalties, in vLLM's order: the repetition penalty (CTRL, Hugging Face's
  `RepetitionPenaltyLogitsProcessor`) on every token of the prompt or the response, logit / p if
  positive else logit * p; then OpenAI's logit -= frequency x count + presence x (count > 0),
  counting the response's tokens only.
- a structured-output constraint (`TokenConstraint`): the tokens its bitmask does not allow get
  -inf; the row's constraint then accepts the token sampled (`stops.StopChecker`).
- a logit bias (OpenAI's and SGLang's `logit_bias`): each (token, bias) pair of the row adds the
  bias to that token's logit, last, as SGLang's `apply_logits_bias` does (a masked token stays
  -inf).

All act on the raw logits, before temperature and the top-k/top-p/min-p filters, and the row
samples from what they leave: its logprobs and top logprobs are those of the penalized, masked,
biased distribution (the behaviour policy; SGLang's logprobs are of the biased distribution too).
Rows of the batch without them are left as they are.

After sampling: the top-k logprobs of each response token (`sampler.top_k_logprobs`) and the
prompt's logprobs (`prompt_logprobs`), which are raw: log_softmax of the model's logits at
temperature 1, no penalty or constraint (vLLM's prompt_logprobs, what /v1/score wants).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import inf, isfinite
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from miles.core.contracts.types import GenerateRequest
from miles.torch.engine.sampler import SamplingTensors, sample, top_k_logprobs

# (token id, logprob) pairs of one position, most likely first.
TopLogprobs = list[tuple[int, float]]


class RowState(Protocol):
    """What processing reads of a row: `batch.Row` (hf path) and `paged.sequence.Sequence`."""

    @property
    def request(self) -> GenerateRequest: ...
    @property
    def response(self) -> list[int]: ...
    @property
    def done(self) -> bool: ...


def samples_next(row: RowState) -> bool:
    """Whether the row's next sampled token is kept: not finished, and with room left (a
    request with max_new_tokens 0 runs only for its prompt logprobs)."""
    return not row.done and len(row.response) < row.request.sampling.max_new_tokens


def sample_rows(
    logits: torch.Tensor,
    rows: Sequence[RowState],
    params: SamplingTensors,
    processor: LogitsProcessor,
    generator: torch.Generator,
    counters: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` ([rows, vocab], one row each of `rows`), after the rows'
    penalties and constraints: (the tokens, `pack`ed tokens, logprobs and top logprobs), both
    on the device."""
    if params.penalized or params.constrained or params.biased:
        logits = processor(logits, rows, params)
    tokens, logprobs = sample(logits, params, generator, counters)
    top = top_k_logprobs(logits, params) if params.top_logprobs else None
    return tokens, pack(tokens, logprobs, top)


def take(row: Any, drawn: npt.NDArray[np.float64], j: int) -> None:
    """Append column `j` of a host copy of `pack`'s output to the row's response."""
    row.response.append(int(drawn[0, j]))
    row.logprobs.append(float(drawn[1, j]))
    k = row.request.sampling.top_logprobs
    if k:
        row.top_logprobs.append(unpack_top(drawn, j, k))


class LogitsProcessor:
    """Penalties and constraint masks of one batch's rows.

    The penalties' token counts live on the device, [penalized rows, vocab], kept from step to
    step (only the tokens sampled since are added, one transfer); when the batch's penalized rows
    change, rows already counted keep their counts and new ones are counted from their prompt
    and response. Constraint bitmasks are filled on the host, one row per constrained row that
    samples, and unpacked on the device. `constraint_vocab`: the vocabulary the
    constraints' bitmasks cover (ceil(constraint_vocab / 32) int32 words a row); logits past it
    (a model's padded vocabulary) are never allowed. Logit biases are static per request: their
    (row, token, bias) triples go to the device once while the batch's rows stay the same.
    """

    def __init__(self, constraint_vocab: int) -> None:
        self.words = -(-constraint_vocab // 32)
        self._rows: list[RowState] = []  # the penalized rows the counts are of
        self._counted: list[int] = []  # response tokens counted per row
        self._picked: list[int] = []  # their indices among the batch's rows
        self._index = torch.zeros(0, dtype=torch.int64)
        self._counts = self._seen = self._params = torch.zeros(0)
        self._bias_rows: list[RowState] = []  # the rows the bias triples below are of
        self._bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[RowState], params: SamplingTensors
    ) -> torch.Tensor:
        """The processed logits (float32, a new tensor) of `rows` ([rows, vocab]); `logits`
        itself is never written (it may be a CUDA graph's output buffer)."""
        if params.penalized:
            logits = self._penalize(logits, rows)
        if params.constrained:
            logits = self._constrain(logits, rows)
        if params.biased:
            logits = self._add_bias(logits, rows)
        return logits

    def _add_bias(self, logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
        """Each row's logit_bias added to its tokens' logits (float32, a new tensor)."""
        same = (
            self._bias is not None
            and len(rows) == len(self._bias_rows)
            and all(a is b for a, b in zip(rows, self._bias_rows, strict=True))
            and self._bias[0].device == logits.device
        )
        if not same:
            triples = [
                (i, token, bias)
                for i, row in enumerate(rows)
                for token, bias in row.request.sampling.logit_bias
            ]
            device = logits.device
            index = torch.tensor([t[0] for t in triples], dtype=torch.int64, device=device)
            tokens = torch.tensor([t[1] for t in triples], dtype=torch.int64, device=device)
            values = torch.tensor([t[2] for t in triples], dtype=torch.float32, device=device)
            self._bias, self._bias_rows = (index, tokens, values), list(rows)
        assert self._bias is not None
        index, tokens, values = self._bias
        out = logits.to(torch.float32, copy=True)
        return out.index_put_((index, tokens), values, accumulate=True)

    def _penalize(self, logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
        picked = [i for i, row in enumerate(rows) if row.request.sampling.penalized]
        if not picked:
            return logits
        penalized = [rows[i] for i in picked]
        same = (
            len(penalized) == len(self._rows)
            and all(a is b for a, b in zip(penalized, self._rows, strict=True))
            and all(len(r.response) >= n for r, n in zip(penalized, self._counted, strict=True))
            and self._counts.shape[-1] == logits.shape[-1]
            and self._counts.device == logits.device
        )
        if not same:
            self._build(penalized, logits.shape[-1], logits.device)
        else:
            self._count_new(penalized)
        if picked != self._picked:
            self._picked = picked
            self._index = torch.tensor(picked, device=logits.device)
        counts, seen = self._counts, self._seen
        frequency, presence, repetition = (p.unsqueeze(1) for p in self._params)
        sub = logits[self._index].float()
        sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
        sub = sub - frequency * counts - presence * (counts > 0)
        return _replace_rows(logits, self._index, sub)

    def _build(self, rows: list[RowState], vocab: int, device: torch.device) -> None:
        """The state of `rows`: a row the old state has keeps its counts (one gather on the
        device); a new one is counted from its prompt and response."""
        n = len(rows)
        old = {id(r): i for i, r in enumerate(self._rows)}
        if self._counts.shape[-1] != vocab or self._counts.device != device:
            old = {}
        kept = [
            (j, old[id(r)])
            for j, r in enumerate(rows)
            if id(r) in old and len(r.response) >= self._counted[old[id(r)]]
        ]
        counted = [0] * n
        counts = torch.zeros((n, vocab), dtype=torch.float32, device=device)
        seen = torch.zeros((n, vocab), dtype=torch.bool, device=device)
        if kept:
            to, src = (torch.tensor(x, device=device) for x in zip(*kept, strict=True))
            counts[to], seen[to] = self._counts[src], self._seen[src]
            for j, i in kept:
                counted[j] = self._counted[i]
        kept_rows = {j for j, _ in kept}
        fresh = [j for j in range(n) if j not in kept_rows]
        if fresh:
            lengths = [len(rows[j].request.prompt_ids) for j in fresh]
            prompt_rows = torch.repeat_interleave(torch.tensor(fresh), torch.tensor(lengths))
            prompt_tokens = torch.tensor(
                [t for j in fresh for t in rows[j].request.prompt_ids], dtype=torch.int64
            )
            seen[prompt_rows.to(device), prompt_tokens.to(device)] = True
        self._rows, self._counted, self._counts, self._seen = list(rows), counted, counts, seen
        self._params = torch.tensor(
            [
                [r.request.sampling.frequency_penalty for r in rows],
                [r.request.sampling.presence_penalty for r in rows],
                [r.request.sampling.repetition_penalty for r in rows],
            ],
            dtype=torch.float32,
            device=device,
        )
        self._count_new(rows)

    def _count_new(self, rows: list[RowState]) -> None:
        """Add the tokens the rows sampled since they were last counted (one transfer)."""
        new = []
        for i, row in enumerate(rows):
            new += [(i, t) for t in row.response[self._counted[i] :]]
            self._counted[i] = len(row.response)
        if not new:
            return
        where = torch.tensor(new, device=self._counts.device).T
        ones = torch.ones(where.shape[1], dtype=torch.float32, device=where.device)
        self._counts.index_put_((where[0], where[1]), ones, accumulate=True)
        self._seen[where[0], where[1]] = True

    def _constrain(self, logits: torch.Tensor, rows: Sequence[RowState]) -> torch.Tensor:
        constrained = [
            (i, row.request)
            for i, row in enumerate(rows)
            if row.request.sampling.constraint is not None and samples_next(row)
        ]
        if not constrained:
            return logits
        bitmask = np.zeros((len(constrained), self.words), dtype=np.int32)
        for j, (_, request) in enumerate(constrained):
            constraint = request.sampling.constraint
            assert constraint is not None
            constraint.fill_bitmask(bitmask, j)
        empty = np.flatnonzero(~bitmask.any(axis=1))
        if len(empty):
            raise RuntimeError(
                f"request {constrained[empty[0]][1].request_id}: its constraint allows no next "
                "token and is not finished"
            )
        device = logits.device
        allowed = unpack_bitmask(torch.from_numpy(bitmask).to(device), logits.shape[-1])
        index = torch.tensor([i for i, _ in constrained], device=device)
        sub = logits[index].float().masked_fill(~allowed, -inf)
        return _replace_rows(logits, index, sub)


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] from int32 words [rows, words]: token t is allowed when bit t % 32 of
    word t // 32 is set; tokens past the words are not. (An arithmetic shift of a negative word
    fills with ones from the left, which `& 1` never reads: bit 31 comes out right.)"""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return F.pad(allowed, (0, vocab - allowed.shape[1]), value=False)


def _replace_rows(logits: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    out = logits.to(torch.float32, copy=True)
    return out.index_copy_(0, index, rows)


def top_pairs(values: npt.ArrayLike, ids: npt.ArrayLike, k: int) -> TopLogprobs:
    """The first `k` (token id, logprob) pairs; tokens of probability 0 (masked) are left out."""
    return [
        (int(t), float(v))
        for v, t in zip(np.asarray(values)[:k], np.asarray(ids)[:k], strict=True)
        if isfinite(v)
    ]


def pack(
    tokens: torch.Tensor, logprobs: torch.Tensor, top: tuple[torch.Tensor, torch.Tensor] | None
) -> torch.Tensor:
    """float64 [2 + 2k, rows] on the device: tokens, logprobs, then the k top logprobs and the k
    top ids (ids are exact in float64), for one transfer to the host."""
    parts = [tokens.double().unsqueeze(0), logprobs.double().unsqueeze(0)]
    if top is not None:
        parts += [top[0].double().T, top[1].double().T]
    return torch.cat(parts)


def unpack_top(drawn: npt.NDArray[np.float64], row: int, k: int) -> TopLogprobs:
    """Row `row`'s first `k` top logprobs from a host copy of `pack`'s output."""
    width = (drawn.shape[0] - 2) // 2
    return top_pairs(drawn[2 : 2 + width, row], drawn[2 + width :, row], k)


def add_prompt_logprobs(row: Any, logits: torch.Tensor, start: int, chunk: int = 1024) -> None:
    """Append to the row's prompt logprobs those of prompt tokens start + 1 .. under `logits`
    [count, vocab] (positions start .. start + count - 1): raw, log_softmax at temperature 1,
    and with top_logprobs k each position's k most likely tokens. In chunks of `chunk`
    positions, so that no [positions, vocab] float32 copy of a long prompt is made."""
    k = row.request.sampling.top_logprobs
    targets = row.request.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    for at in range(0, len(targets), chunk):
        logprobs = torch.log_softmax(logits[at : at + chunk].float(), dim=-1)
        want = torch.tensor(targets[at : at + chunk], device=logits.device)
        picked = logprobs.gather(1, want.unsqueeze(1)).squeeze(1)
        top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1) if k else None
        host = pack(want, picked, top).cpu().numpy()
        row.prompt_logprobs += host[1].tolist()
        if k:
            row.prompt_top_logprobs += [unpack_top(host, j, k) for j in range(host.shape[1])]


def result_fields(row: Any) -> dict[str, Any]:
    """The `GenerateResult` fields of the extras the row's request asked for (None otherwise)."""
    sampling = row.request.sampling
    asked_prompt = sampling.prompt_logprobs
    return {
        "top_logprobs": row.top_logprobs if sampling.top_logprobs else None,
        "prompt_logprobs": row.prompt_logprobs if asked_prompt else None,
        "prompt_top_logprobs": (
            row.prompt_top_logprobs if asked_prompt and sampling.top_logprobs else None
        ),
    }
