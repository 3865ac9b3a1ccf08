"""The sampler's pieces, exactly: per-row parameter tensors, the top-k/top-p candidate set, and the
inverse-CDF draw. Tiny tensors, no model (test_engine_sampling.py checks the distributions)."""

from __future__ import annotations

from math import inf, log

import pytest
import torch

from miles.core.contracts.types import SamplingParams
from miles.torch.engine import sample_kernel
from miles.torch.engine.sampler import (
    NO_SEED,
    SamplingTensors,
    _draw,
    _top_k_top_p,
    sample,
    seeded_uniform,
)

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
    params = [SamplingParams(0.7, 0.9, 5, min_p=0.1), SamplingParams(0.0, 1.0, -1, seed=2**40)]
    meta = SamplingTensors.from_params(params, torch.device("meta"))
    fields = (meta.temperature, meta.top_p, meta.top_k, meta.min_p, meta.seed)
    assert [t.device.type for t in fields] == ["meta"] * 5
    cpu = SamplingTensors.from_params(params, torch.device("cpu"))
    assert cpu.temperature.tolist() == pytest.approx([0.7, 0.0])
    assert cpu.top_p.tolist() == pytest.approx([0.9, 1.0])
    assert cpu.top_k.tolist() == [5, -1]
    assert cpu.min_p.tolist() == pytest.approx([0.1, 0.0])
    assert cpu.seed.tolist() == [NO_SEED, 2**40]  # no seed: the engine's generator
    fields = (cpu.temperature, cpu.top_p, cpu.top_k, cpu.min_p, cpu.seed)
    f32, i64 = torch.float32, torch.int64
    assert [t.dtype for t in fields] == [f32, f32, i64, f32, i64]
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


def test_draw_gives_each_token_a_half_open_cdf_interval() -> None:
    """Token i owns [cdf[i-1], cdf[i]) of the (unnormalised) mass: a uniform of exactly 0, which
    both the generator and a seed can give, draws the first token with any mass, never a
    zero-probability token before it, and a uniform on a boundary belongs to the next token."""
    logprobs = torch.tensor([[-inf, 0.0, -inf, 0.0, -inf]]).expand(3, -1)  # masses 0, 1, 0, 1, 0
    index = _draw(logprobs, torch.tensor([0.0, 0.5, 0.9999]))
    assert index.tolist() == [1, 3, 3]


def _lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32 in Python integers."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _seeded_reference(seed: int, counter: int) -> float:
    """The seeded stream: the low then the high 32 bits of the seed, then the counter, hashed
    in turn; the top 24 bits of the result as a fraction of 2**24."""
    h = _lowbias32(_lowbias32(_lowbias32(seed) ^ (seed >> 32)) ^ counter)
    return (h >> 8) / 2**24


def test_seeded_uniform_is_a_fixed_uniform_function_of_seed_and_counter() -> None:
    seeds = torch.tensor([0, 1, 12345, 2**32 + 1, 2**62 + 12345])
    counters = torch.tensor([0, 7, 0, 7, 4095])
    u = seeded_uniform(seeds, counters)
    assert u.dtype == torch.float32 and u.shape == (5,)
    want = [_seeded_reference(s, c) for s, c in zip(seeds.tolist(), counters.tolist(), strict=True)]
    assert u.tolist() == want  # exact: the same stream on every device and in every release
    # Seeds that differ only above bit 32 give different streams.
    stream = seeded_uniform(torch.full((64,), 5), torch.arange(64))
    high = seeded_uniform(torch.full((64,), 5 + 2**40), torch.arange(64))
    assert not torch.equal(stream, high)
    # Over many counters: in [0, 1) and spread over all of it.
    many = seeded_uniform(torch.full((4096,), 3), torch.arange(4096))
    assert float(many.min()) >= 0.0 and float(many.max()) < 1.0
    assert float(many.max()) > 0.99 and float(many.min()) < 0.01
    assert abs(float(many.mean()) - 0.5) < 0.02


def _seeded(seeds: list[int | None]) -> SamplingTensors:
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in seeds]
    return SamplingTensors.from_params(params, torch.device("cpu"))


def test_seeded_rows_draw_from_their_seed_whatever_their_batch_and_generator() -> None:
    """A seeded request samples its n-th token at seeded_uniform(seed, n): the same tokens alone
    or batched (via `cat`) with unseeded rows, whatever the engine's generator."""
    rows = 32
    logits = _logprobs(rows, order=[3, 0, 4, 1, 2])
    counters = torch.arange(rows)
    alone, _ = sample(logits, _seeded([11] * rows), _gen(1), counters)
    batch = SamplingTensors.cat([_seeded([None] * 3), _seeded([11] * rows)])
    assert batch.seeded and batch.seed.tolist() == [NO_SEED] * 3 + [11] * rows
    mixed_logits = torch.cat([_logprobs(3), logits])
    mixed, _ = sample(
        mixed_logits, batch, _gen(2), torch.cat([torch.zeros(3, dtype=torch.int64), counters])
    )
    assert mixed[3:].tolist() == alone.tolist()
    probs = torch.tensor([PROBS[[3, 0, 4, 1, 2].index(v)] for v in range(VOCAB)])
    u = seeded_uniform(torch.full((rows,), 11), counters)
    want = torch.searchsorted(probs.cumsum(0), u * probs.sum(), right=True)
    assert alone.tolist() == want.tolist()


def test_seeded_rows_without_counters_are_an_error() -> None:
    with pytest.raises(ValueError, match="counters"):
        sample(_logprobs(2), _seeded([None, 4]), _gen(0))


def _fused_reference(
    logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `sample_kernel.fused_sample` computes (its docstring), in torch."""
    logprobs = torch.log_softmax(logits.float() / temperature.unsqueeze(1), dim=-1)
    cdf = logprobs.exp().cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    tokens = torch.where(greedy, logprobs.argmax(dim=-1), drawn.clamp(max=cdf.shape[1] - 1))
    return tokens, logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Pretend the Triton kernel runs on any device (its torch reference standing in for it);
    the logits of each fused call are recorded."""
    calls: list[torch.Tensor] = []

    def fused(logits: torch.Tensor, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(logits)
        return _fused_reference(logits, *args)

    monkeypatch.setattr(sample_kernel, "available", lambda logits: logits.dim() == 2)
    monkeypatch.setattr(sample_kernel, "fused_sample", fused)
    return calls


def test_the_fused_kernel_draws_what_the_torch_path_draws(
    monkeypatch: pytest.MonkeyPatch, fused_calls: list[torch.Tensor]
) -> None:
    """Unfiltered rows (a top-k as wide as the vocabulary filters nothing) go to the fused
    kernel with the same uniforms from the engine's generator: the same tokens and logprobs
    as the torch path. Rows with a real filter stay on the torch path."""
    rows = 64
    logits = _logprobs(rows, order=[2, 4, 0, 1, 3]) * torch.linspace(0.5, 2.0, rows)[:, None]
    params = _params(*[((0.0, 0.7, 1.0, 1.3)[i % 4], (-1, VOCAB)[i % 2], 1.0) for i in range(rows)])
    fused = sample(logits, params, _gen(3))
    assert len(fused_calls) == 1 and fused_calls[0] is logits
    monkeypatch.setattr(sample_kernel, "available", lambda logits: False)
    plain = sample(logits, params, _gen(3))
    assert fused[0].tolist() == plain[0].tolist()
    torch.testing.assert_close(fused[1], plain[1])
    monkeypatch.setattr(sample_kernel, "available", lambda logits: True)
    sample(logits, _params(*[(1.0, 2, 1.0)] * rows), _gen(3))
    sample(logits, _params(*[(1.0, -1, 0.9)] * rows), _gen(3))
    assert len(fused_calls) == 1


def test_an_all_greedy_batch_gives_the_fused_kernel_its_inputs_on_the_logits_device(
    fused_calls: list[torch.Tensor],
) -> None:
    """(meta stands in for the GPU: a kernel given a host tensor fails.)"""
    device = torch.device("meta")
    params = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 3, device)
    tokens, logprobs = sample(torch.zeros(3, VOCAB, device=device), params, _gen(0))
    assert len(fused_calls) == 1
    assert tokens.device == logprobs.device == device and tokens.shape == (3,)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
