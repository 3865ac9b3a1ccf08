"""The sampler's pieces, exactly: per-row parameter tensors, the top-k/top-p candidate set, and the
inverse-CDF draw. Tiny tensors, no model (test_engine_sampling.py checks the distributions)."""

from __future__ import annotations

from math import inf, log

import pytest
import torch

from miles.core.types import SamplingParams
from miles.torch.engine.sampler import SamplingTensors, _draw, _top_k_top_p, sample

PROBS = [0.5, 0.3, 0.1, 0.06, 0.04]
VOCAB = len(PROBS)


def _params(*rows: tuple[float, int, float]) -> SamplingTensors:
    """(temperature, top_k, top_p) per row, on the CPU."""
    return SamplingTensors.from_params(
        [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in rows], torch.device("cpu")
    )


def _logprobs(rows: int, order: list[int] | None = None) -> torch.Tensor:
    """log(PROBS) in each row; `order` permutes the vocabulary (PROBS[i] goes to token order[i])."""
    row = torch.empty(VOCAB)
    row[torch.tensor(order or list(range(VOCAB)))] = torch.tensor(PROBS).log()
    return row.expand(rows, -1).clone()


def test_from_params_puts_every_field_on_the_device_with_its_dtype() -> None:
    params = [SamplingParams(0.7, 0.9, 5), SamplingParams(0.0, 1.0, -1)]
    meta = SamplingTensors.from_params(params, torch.device("meta"))
    assert [t.device.type for t in (meta.temperature, meta.top_p, meta.top_k)] == ["meta"] * 3
    cpu = SamplingTensors.from_params(params, torch.device("cpu"))
    assert cpu.temperature.tolist() == pytest.approx([0.7, 0.0])
    assert cpu.top_p.tolist() == pytest.approx([0.9, 1.0])
    assert cpu.top_k.tolist() == [5, -1]
    assert (cpu.temperature.dtype, cpu.top_p.dtype, cpu.top_k.dtype) == (
        torch.float32,
        torch.float32,
        torch.int64,
    )
    # No rows (an empty slice of a batch): top_k is still int64, so concatenating keeps it int64.
    empty = SamplingTensors.from_params([], torch.device("cpu"))
    assert empty.top_k.dtype == torch.int64 and empty.temperature.dtype == torch.float32
    assert SamplingTensors.cat([empty, cpu]).top_k.dtype == torch.int64


def test_select_and_cat_keep_rows_together() -> None:
    params = _params((0.5, 1, 0.1), (1.0, 2, 0.2), (1.5, 3, 0.3))
    picked = params.select(torch.tensor([2, 0]))
    assert picked.top_k.tolist() == [3, 1]
    assert picked.temperature.tolist() == pytest.approx([1.5, 0.5])
    both = SamplingTensors.cat([picked, params.select(torch.tensor([1]))])
    assert both.top_k.tolist() == [3, 1, 2]
    assert both.top_p.tolist() == pytest.approx([0.3, 0.1, 0.2])


@pytest.mark.parametrize("top_k", [-1, 0, VOCAB, VOCAB + 3])
def test_nothing_filtered_returns_the_vocabulary_in_order(top_k: int) -> None:
    logprobs = _logprobs(2, order=[3, 0, 4, 1, 2])
    candidates, ids = _top_k_top_p(logprobs, _params((1.0, top_k, 1.0), (0.5, -1, 1.0)))
    assert ids is None and candidates is logprobs


def _finite(candidates: torch.Tensor, ids: torch.Tensor) -> list[list[int]]:
    """Each row's candidate token ids (those not at -inf), best first."""
    return [row_ids[row > -inf].tolist() for row, row_ids in zip(candidates, ids, strict=True)]


def test_top_k_keeps_exactly_k_tokens_and_0_means_off() -> None:
    logprobs = _logprobs(3, order=[3, 0, 4, 1, 2])  # best first: tokens 3, 0, 4, 1, 2
    candidates, ids = _top_k_top_p(logprobs, _params((1, 2, 1.0), (1, 0, 1.0), (1, -1, 1.0)))
    assert ids is not None and candidates.shape == (3, VOCAB)  # one row without top-k: full width
    assert _finite(candidates, ids) == [[3, 0], [3, 0, 4, 1, 2], [3, 0, 4, 1, 2]]
    # Kept candidates are the unchanged logprobs of their tokens; the others are exactly -inf.
    kept = candidates > -inf
    torch.testing.assert_close(candidates[kept], logprobs.gather(1, ids)[kept])
    assert bool((candidates[~kept] == -inf).all())


def test_when_every_row_has_a_top_k_only_the_largest_k_are_sorted() -> None:
    logprobs = _logprobs(2, order=[1, 2, 3, 4, 0])  # best first: 1, 2, 3, 4, 0
    candidates, ids = _top_k_top_p(logprobs, _params((1, 2, 1.0), (1, 3, 1.0)))
    assert ids is not None and candidates.shape == ids.shape == (2, 3)
    assert ids.tolist() == [[1, 2, 3], [1, 2, 3]]
    assert _finite(candidates, ids) == [[1, 2], [1, 2, 3]]


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [
        (-1, 0.7, 2),  # mass before the third token is 0.8 >= 0.7
        (-1, 0.85, 3),  # 0.8 < 0.85: the third stays; before the fourth, 0.9
        (-1, 0.45, 1),
        (-1, 0.01, 1),  # the top token always stays
        (3, 0.85, 2),  # over the top 3 renormalised: mass before the third is 0.889
        (4, 0.93, 3),  # top 4 renormalised (0.521, 0.313, 0.104, 0.063): before the 4th, 0.938
    ],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_k: int, top_p: float, kept: int) -> None:
    logprobs = _logprobs(1, order=[2, 4, 0, 1, 3])  # best first: 2, 4, 0, 1, 3
    candidates, ids = _top_k_top_p(logprobs, _params((1.0, top_k, top_p)))
    assert ids is not None
    assert _finite(candidates, ids) == [[2, 4, 0, 1, 3][:kept]]


def test_rows_filter_independently() -> None:
    logprobs = _logprobs(3)
    candidates, ids = _top_k_top_p(logprobs, _params((1, -1, 0.7), (1, 1, 1.0), (1, -1, 1.0)))
    assert ids is not None
    assert _finite(candidates, ids) == [[0, 1], [0], [0, 1, 2, 3, 4]]


def test_unfiltered_draw_is_the_inverse_cdf_over_the_vocabulary_order() -> None:
    """One uniform per row, mapped through the CDF of the tokens in vocabulary order: seeded
    sampling gives the same tokens as any sampler that follows this rule."""
    rows = 64
    order = [3, 0, 4, 1, 2]
    logits = _logprobs(rows, order=order) + 2.0  # logits, not normalised
    tokens, logprobs = sample(logits, _params(*[(1.0, -1, 1.0)] * rows), _gen(5))
    probs = torch.tensor([PROBS[order.index(v)] for v in range(VOCAB)])
    u = torch.rand((rows, 1), generator=_gen(5)).squeeze(1)
    want = torch.searchsorted(probs.cumsum(0), u * probs.sum(), right=True)
    assert tokens.tolist() == want.tolist()
    torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_filtered_draw_is_the_inverse_cdf_over_the_kept_tokens_best_first() -> None:
    rows = 64
    logits = _logprobs(rows, order=[3, 0, 4, 1, 2])
    tokens, _ = sample(logits, _params(*[(1.0, 3, 1.0)] * rows), _gen(9))
    kept = torch.tensor(PROBS[:3])  # tokens 3, 0, 4
    u = torch.rand((rows, 1), generator=_gen(9)).squeeze(1)
    index = torch.searchsorted(kept.cumsum(0), u * kept.sum(), right=True)
    assert tokens.tolist() == torch.tensor([3, 0, 4])[index].tolist()


def test_temperature_scales_the_logprobs_and_greedy_rows_take_the_argmax() -> None:
    logits = _logprobs(2, order=[1, 0, 2, 3, 4])
    tokens, logprobs = sample(logits, _params((0.0, -1, 1.0), (0.0, 2, 0.5)), _gen(0))
    assert tokens.tolist() == [1, 1]
    assert logprobs.tolist() == pytest.approx([log(0.5)] * 2, abs=1e-6)
    tokens, logprobs = sample(logits, _params((0.5, 1, 1.0), (2.0, 1, 1.0)), _gen(0))
    assert tokens.tolist() == [1, 1]  # top-k 1: the best token, at any temperature
    for row, temperature in enumerate((0.5, 2.0)):
        scaled = torch.log_softmax(logits[row] / temperature, dim=-1)
        assert float(logprobs[row]) == pytest.approx(float(scaled[1]), abs=1e-6)


def test_draw_never_picks_a_zero_probability_entry() -> None:
    logprobs = torch.tensor([[-inf, log(0.25), -inf, log(0.75), -inf]]).expand(2000, -1)
    index = _draw(logprobs, torch.rand(len(logprobs), generator=_gen(1)))
    counts = torch.bincount(index, minlength=5).tolist()
    assert counts[0] == counts[2] == counts[4] == 0
    assert 400 < counts[1] < 600  # 500 expected


def test_draw_stays_in_range_on_a_nan_row() -> None:
    """A row of NaN (a broken model) still draws an index that exists, not one past the end."""
    logprobs = torch.tensor([[float("nan")] * 4, [0.0, -inf, -inf, -inf]])
    index = _draw(logprobs, torch.rand(len(logprobs), generator=_gen(0)))
    assert 0 <= int(index[0]) < 4 and int(index[1]) == 0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
