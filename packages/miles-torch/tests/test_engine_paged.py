"""The paged engine path (`rollout.path: paged`) on CPU: logprobs against a plain
transformers forward, greedy outputs against `generate()`, and the same tokens with and without
preemption, chunked prefill and prefix-cache hits. Its GPU kernels are tested in
test_engine_paged_gpu.py."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.engine.paged.pages import PagePool
from miles.torch.engine.paged.scheduler import Scheduler
from miles.torch.engine.paged.sequence import Sequence

torch.set_num_threads(1)

PROMPT_LENS = [5, 17, 9, 2, 30, 11, 1, 23]


def settings(**overrides) -> TorchEngineConfig:
    values = dict(
        page_size=4,
        max_batch_size=4,
        max_context=128,
        max_prefill_tokens=64,
    )
    return TorchEngineConfig(**{**values, **overrides})


def paged_engine(path: str, **overrides) -> TorchRolloutEngine:
    s = settings(**overrides)
    return TorchRolloutEngine(path, max_batch_size=s.max_batch_size, path="paged", paged=s)


def make_requests(sampling: SamplingParams, lens=PROMPT_LENS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        GenerateRequest(i, torch.randint(3, 128, (n,), generator=g).tolist(), sampling)
        for i, n in enumerate(lens)
    ]


def run(engine, requests):
    return {r.request_id: r for r in engine.results(requests)}


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_paged_logprobs_match_transformers_forward(tiny_model, temperature):
    path = tiny_model("qwen3")
    engine = paged_engine(path)
    assert engine.health()["path"] == "paged"
    sampling = SamplingParams(temperature=temperature, top_k=50, max_new_tokens=12)
    requests = make_requests(sampling)
    results = run(engine, requests)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for req in requests:
        res = results[req.request_id]
        assert len(res.response_ids) == len(res.logprobs) > 0
        with torch.no_grad():
            logits = model(torch.tensor([req.prompt_ids + res.response_ids])).logits[0].float()
        n = len(req.prompt_ids)
        ref = torch.log_softmax(logits[n - 1 : -1] / (temperature or 1.0), dim=-1)
        chosen = ref.gather(1, torch.tensor(res.response_ids).unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(res.logprobs), chosen, rtol=0, atol=1e-4)


def test_paged_greedy_equals_generate(tiny_model):
    path = tiny_model("qwen3")
    requests = make_requests(SamplingParams(temperature=0.0, max_new_tokens=10))
    results = run(paged_engine(path), requests)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for req in requests:
        out = model.generate(
            torch.tensor([req.prompt_ids]), max_new_tokens=10, do_sample=False, eos_token_id=None
        )
        expected = out[0, len(req.prompt_ids) :].tolist()
        got = results[req.request_id].response_ids
        assert got == expected[: len(got)] and len(got) in (len(expected), 10)


def test_preemption_chunking_and_prefix_hits_change_nothing(tiny_model):
    """A cache too small for every row (rows preempted and recomputed), prompts prefilled in
    chunks of 8 tokens, groups of samples sharing a prompt, and rows that stop at different
    steps (inside decode bursts): the same greedy tokens and logprobs as a roomy run."""
    path = tiny_model("qwen3")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=20)
    prompts = make_requests(sampling, lens=[30, 9, 17, 23])
    group = [
        GenerateRequest(
            10 * p.request_id + i,
            p.prompt_ids,
            SamplingParams(temperature=0.0, max_new_tokens=(20, 11, 5)[i]),
        )
        for p in prompts
        for i in range(3)
    ]
    roomy = run(paged_engine(path, max_batch_size=16), group)
    tight = paged_engine(path, max_batch_size=16, kv_cache_tokens=80, max_prefill_tokens=8)
    squeezed = run(tight, group)
    assert tight._paged.scheduler.preemptions > 0
    assert tight._paged.prefix_hit_rate > 0
    for rid, res in roomy.items():
        assert squeezed[rid].response_ids == res.response_ids
        torch.testing.assert_close(
            torch.tensor(squeezed[rid].logprobs), torch.tensor(res.logprobs), rtol=0, atol=1e-5
        )


def test_a_group_prefills_its_prompt_once_and_a_later_turn_reuses_it(tiny_model):
    path = tiny_model("qwen3")
    engine = paged_engine(path, max_batch_size=8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    prompt = list(range(3, 3 + 21))  # 5 full pages of 4 (the last token is always computed)
    first = run(engine, [GenerateRequest(i, prompt, sampling) for i in range(4)])
    assert [first[i].cached_tokens for i in range(4)] == [0, 20, 20, 20]
    # The next turn: the conversation so far plus a new user message.
    turn = prompt + first[0].response_ids + [7, 8, 9]
    second = run(engine, [GenerateRequest(9, turn, sampling)])
    assert second[9].cached_tokens == (len(prompt) + 6) // 4 * 4
    # New weights make every cached prefix stale.
    engine.load_weights([], version=1)
    third = run(engine, [GenerateRequest(10, turn, sampling)])
    assert third[10].cached_tokens == 0


def test_the_pool_never_hands_out_a_page_twice():
    pool = PagePool(num_pages=9, page_size=4)
    scheduler = Scheduler(pool, max_batch_size=8, max_prefill_tokens=100)
    params = SamplingParams(max_new_tokens=40)
    seqs = [Sequence(GenerateRequest(i, [i + 3] * 6, params), order=i) for i in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(30):
        step = scheduler.schedule()
        for seq, n in zip(step.seqs, step.chunks, strict=True):
            seq.num_computed += n
        for seq in step.sampled():
            seq.response.append(5)
        owned = [p for s in scheduler.running for p in s.pages]
        assert len(owned) == len(set(owned)) and 0 not in owned
        assert len(owned) + pool.num_free == pool.num_pages - 1
        assert all(len(s.pages) * 4 >= len(s) for s in scheduler.running)


def test_a_request_larger_than_the_cache_is_refused_clearly(tiny_model):
    engine = paged_engine(tiny_model("qwen3"), kv_cache_tokens=16)
    request = GenerateRequest(0, list(range(3, 40)), SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="KV pages"):
        list(engine.results([request]))
    too_long = GenerateRequest(1, [3] * 120, SamplingParams(max_new_tokens=20))
    with pytest.raises(ValueError, match="max_context"):
        list(engine.results([too_long]))


def test_paged_refuses_a_family_it_has_no_forward_for(tiny_model):
    with pytest.raises(ValueError, match="no paged forward"):
        paged_engine(tiny_model("deepseek_v3"))
    auto = TorchRolloutEngine(tiny_model("deepseek_v3"), path="auto")
    assert auto.health()["path"] == "hf"


def test_paged_moe_equals_the_hf_path_and_records_the_same_routes(tiny_model):
    """Qwen3-MoE on the paged path, with groups sharing prompts, a cache small enough to
    preempt, and chunked prefill: the same greedy tokens, logprobs and routing records (experts
    and gate weights) as the hf path, which hooks transformers' own routers."""
    path = tiny_model("qwen3_moe")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = make_requests(sampling, lens=[30, 9, 17, 23])
    group = [
        GenerateRequest(10 * p.request_id + i, p.prompt_ids, sampling)
        for p in prompts
        for i in range(3)
    ]
    hf = TorchRolloutEngine(path, max_batch_size=16, record_routing="ids+weights")
    want = run(hf, group)
    s = settings(max_batch_size=16, kv_cache_tokens=96, max_prefill_tokens=8)
    paged = TorchRolloutEngine(
        path, max_batch_size=16, path="paged", paged=s, record_routing="ids+weights"
    )
    got = run(paged, group)
    assert paged._paged.scheduler.preemptions > 0 and paged._paged.prefix_hit_rate > 0
    for rid, res in want.items():
        mine = got[rid]
        assert mine.response_ids == res.response_ids
        torch.testing.assert_close(
            torch.tensor(mine.logprobs), torch.tensor(res.logprobs), rtol=0, atol=1e-4
        )
        assert mine.routing is not None and res.routing is not None
        assert mine.routing.dtype == res.routing.dtype
        assert mine.routing.shape == res.routing.shape  # [prompt + response, layers, top_k]
        assert (mine.routing[-1] == -1).all()  # the last token was never fed
        assert (mine.routing[:-1] >= 0).all()
        assert (mine.routing == res.routing).all(), rid
        torch.testing.assert_close(
            torch.tensor(mine.routing_weights), torch.tensor(res.routing_weights), atol=1e-5, rtol=0
        )


def test_a_seeded_request_samples_the_same_tokens_however_it_is_run(tiny_model):
    """Alone or batched with others, on the hf or the paged path, with or without preemption:
    a request with a seed draws the same tokens; another seed draws others."""
    path = tiny_model("qwen3")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seed=1234)
    prompt = list(range(3, 40))
    mine = GenerateRequest(0, prompt, seeded)
    others = make_requests(SamplingParams(temperature=1.0, max_new_tokens=16), lens=[30, 9, 17])
    others = [GenerateRequest(r.request_id + 1, r.prompt_ids, r.sampling) for r in others]
    hf = TorchRolloutEngine(path, max_batch_size=8)
    alone = run(hf, [mine])[0]
    runs = {
        "hf batched": run(hf, [*others, mine])[0],
        "paged": run(paged_engine(path, max_batch_size=8), [mine])[0],
        "paged batched, preempted": run(
            tight := paged_engine(path, max_batch_size=8, kv_cache_tokens=88), [*others, mine]
        )[0],
    }
    assert tight._paged.scheduler.preemptions > 0
    for how, result in runs.items():
        assert result.response_ids == alone.response_ids, how
        torch.testing.assert_close(
            torch.tensor(result.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-4
        )
    reseeded = GenerateRequest(0, prompt, SamplingParams(**{**vars(seeded), "seed": 99}))
    assert run(hf, [reseeded])[0].response_ids != alone.response_ids


def test_seeded_uniforms_are_uniform_and_depend_on_seed_and_counter_only():
    from miles.torch.engine.sampler import seeded_uniform

    counters = torch.arange(200_000)
    u = seeded_uniform(torch.full_like(counters, 5), counters)
    assert float(u.min()) >= 0 and float(u.max()) < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = len(u) / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.82  # chi-square, 19 degrees of freedom, p = 0.001
    assert torch.equal(u, seeded_uniform(torch.full_like(counters, 5), counters))
    other = seeded_uniform(torch.full_like(counters, 6), counters)
    assert float((u == other).float().mean()) < 1e-3
    big = seeded_uniform(torch.full_like(counters, 5 + 2**40), counters)
    assert float((u == big).float().mean()) < 1e-3  # the high bits of a seed count too


def test_pause_hands_back_unfinished_requests_and_frees_their_pages(tiny_model):
    engine = paged_engine(tiny_model("qwen3"), max_batch_size=4)
    lens = [4, 40, 9, 30, 11, 7]  # more requests than rows: some are still waiting
    requests = [
        GenerateRequest(
            i,
            list(range(3, 3 + n)),
            SamplingParams(temperature=0.0, max_new_tokens=2 if i == 0 else 30),
        )
        for i, n in enumerate(lens)
    ]
    stream = engine.generate(requests)
    first = next(stream)
    assert [r.request_id for r in first] == [0] and first[0].finish_reason == "length"
    engine.pause()
    rest = {r.request_id: r for batch in stream for r in batch}
    assert sorted(rest) == [1, 2, 3, 4, 5]
    assert all(r.finish_reason == "abort" for r in rest.values())
    assert any(r.response_ids for r in rest.values())  # running rows keep their tokens so far
    runner = engine._paged
    assert runner.pool.num_free == runner.pool.num_pages - 1
    with pytest.raises(RuntimeError, match="paused"):
        engine.generate(requests)
    engine.resume()
    again = run(engine, requests[:2])
    assert [again[i].finish_reason for i in (0, 1)] == ["length", "length"]


# Chi-square critical values at p = 0.001 by degrees of freedom (support size - 1).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47}


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p", "want"),
    [
        (1.0, -1, 1.0, 0.0, [0.5, 0.3, 0.1, 0.06, 0.04]),
        (1.0, 2, 1.0, 0.0, [0.625, 0.375, 0, 0, 0]),
        (1.0, -1, 0.7, 0.0, [0.625, 0.375, 0, 0, 0]),  # mass before token 2 is 0.8 >= 0.7
        (1.0, -1, 1.0, 0.15, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0, 0]),  # >= 0.15 x 0.5
        (1.0, 4, 1.0, 0.1, [0.5 / 0.96, 0.3 / 0.96, 0.1 / 0.96, 0.06 / 0.96, 0]),
        (
            0.5,
            -1,
            1.0,
            0.0,
            [0.25 / 0.3552, 0.09 / 0.3552, 0.01 / 0.3552, 0.0036 / 0.3552, 0.0016 / 0.3552],
        ),
    ],
)
def test_paged_sampler_draws_from_exactly_the_filtered_distribution(
    temperature, top_k, top_p, min_p, want
):
    from miles.torch.engine.sampler import SamplingTensors, sample

    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    n = 40_000
    logits = probs.log().expand(n, -1)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    batch = SamplingTensors.from_params([params] * n, torch.device("cpu"))
    tokens, logprobs = sample(logits, batch, torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=5).double()
    want = torch.tensor(want, dtype=torch.float64)
    support = want > 0
    assert (counts[~support] == 0).all(), counts  # nothing outside the support, ever
    expected = want[support] * n
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[int(support.sum()) - 1], (chi2, counts)
    # Logprobs are always of the unfiltered, temperature-scaled distribution.
    unfiltered = torch.log_softmax(logits[0] / temperature, dim=-1)
    torch.testing.assert_close(logprobs, unfiltered[tokens], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kv_cache_tokens", [None, 200])
def test_the_memory_plan_counts_the_cache_the_paged_engine_allocates(tiny_model, kv_cache_tokens):
    from miles.core.config import parse
    from miles.runtime.planning.planner import plan

    path = tiny_model("qwen3")
    rollout = dict(max_batch_size=3, max_context=40, page_size=4, path="paged")
    if kv_cache_tokens is not None:
        rollout["kv_cache_tokens"] = kv_cache_tokens
    run = parse(
        {
            "model": {"path": path},
            "data": {"path": "x.jsonl"},
            "rollout": {**rollout, "prompts_per_step": 2, "samples_per_prompt": 2},
            "precision": "fp32",
        }
    )
    planned = plan(run).rollout.kv_cache
    engine = paged_engine(path, **{k: v for k, v in rollout.items() if k != "path"})
    cache = engine._paged.kv
    allocated = cache.numel() * cache.element_size()
    page = allocated / cache.shape[2]
    # The engine adds its scratch page and rounds up to whole pages.
    assert planned <= allocated <= planned + 2 * page
    assert planned == (kv_cache_tokens or 3 * 40) * page / 4
