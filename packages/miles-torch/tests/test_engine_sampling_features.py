"""The sampling fields beyond plain sampling (ignore_eos, penalties, stop_regex, top and prompt
logprobs, structured-output constraints) on both generation loops, against independent
references: a plain transformers forward, transformers' own `RepetitionPenaltyLogitsProcessor`,
OpenAI's penalty formula by hand and test doubles of `TokenConstraint`. The GPU cases run the
paged path with CUDA graphs, decode bursts and the fused sampling kernel."""

import json
import re
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, RepetitionPenaltyLogitsProcessor

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.engine.logits import LogitsProcessor, unpack_bitmask
from miles.torch.engine.sampler import SamplingTensors

torch.set_num_threads(1)

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
SETUPS = [
    pytest.param(("hf", "cpu"), id="hf-cpu"),
    pytest.param(("paged", "cpu"), id="paged-cpu"),
    pytest.param(("hf", "cuda"), id="hf-cuda", marks=GPU),
    pytest.param(("paged", "cuda"), id="paged-cuda", marks=GPU),
]
PROMPTS = [[5, 6, 7, 8, 5, 6], list(range(40, 70)), [90, 12, 13, 12, 90], [33]]
ATOL = 1e-4


def make_engine(path: str, setup: tuple[str, str]) -> TorchRolloutEngine:
    kind, device = setup
    if kind == "hf":
        return TorchRolloutEngine(path, device=device, max_batch_size=3, seed=0)
    # Small pages and prefill chunks: prompts are prefilled in several chunks and groups share
    # pages. On CUDA: graphs and decode bursts of 4.
    settings = TorchEngineConfig(
        page_size=4 if device == "cpu" else 16,
        max_batch_size=3,
        max_context=128,
        max_prefill_tokens=16,
        decode_burst=4,
    )
    return TorchRolloutEngine(
        path, device=device, max_batch_size=3, seed=0, path="paged", paged=settings
    )


@pytest.fixture(scope="module", params=SETUPS)
def setup(request):
    return request.param


@pytest.fixture(scope="module")
def engine(tiny_model, setup):
    return make_engine(tiny_model("qwen3"), setup)


@pytest.fixture(scope="module")
def model(tiny_model, setup):
    return AutoModelForCausalLM.from_pretrained(tiny_model("qwen3")).to(setup[1]).eval()


def run(engine, requests):
    return {r.request_id: r for r in engine.results(requests)}


def requests_for(prompts, **sampling):
    params = SamplingParams(**{"max_new_tokens": 10, **sampling})
    return [GenerateRequest(i, p, params) for i, p in enumerate(prompts)]


def as_ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """Next-token logits [len(ids), vocab] (fp32, on the CPU) of a plain forward."""
    with torch.no_grad():
        out = model(torch.tensor([ids], device=model.device)).logits[0]
    return out.float().cpu()


def response_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The logits each response token was drawn from, [len(response), vocab]."""
    return logits_of(model, prompt + response)[len(prompt) - 1 : -1]


def temperature_of(sampling: SamplingParams) -> float:
    return sampling.temperature if sampling.temperature > 0 else 1.0


# ── ignore_eos ──────────────────────────────────────────────────────────────────────────────────


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory, setup):
    """A copy of the tiny model whose generation config also ends sequences at the third token
    of the greedy continuation of PROMPTS[0] (from transformers' own `generate`)."""
    path = tiny_model("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = model.generate(
        torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False, eos_token_id=None
    )
    greedy = out[0, len(PROMPTS[0]) :].tolist()
    eos = greedy[2]
    copy = Path(shutil.copytree(path, tmp_path_factory.mktemp("eos") / "model"))
    config = json.loads((copy / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], eos]
    (copy / "generation_config.json").write_text(json.dumps(config))
    return make_engine(str(copy), setup), greedy, eos


def test_ignore_eos_generates_past_the_models_eos_but_stop_token_ids_still_stop(eos_model):
    engine, greedy, eos = eos_model
    cut = greedy.index(eos) + 1
    base = dict(temperature=0.0, max_new_tokens=12)
    stopped, ignored, explicit = (
        run(engine, [GenerateRequest(0, PROMPTS[0], SamplingParams(**base, **extra))])[0]
        for extra in ({}, {"ignore_eos": True}, {"ignore_eos": True, "stop_token_ids": (eos,)})
    )
    assert stopped.response_ids == greedy[:cut] and stopped.finish_reason == "stop"
    assert ignored.response_ids == greedy and ignored.finish_reason == "length"
    assert explicit.response_ids == greedy[:cut] and explicit.finish_reason == "stop"


# ── penalties ───────────────────────────────────────────────────────────────────────────────────


def penalized_reference(model, prompt, response, sampling) -> torch.Tensor:
    """The logits each response token was drawn from after the penalties: transformers'
    repetition-penalty processor over prompt + response so far, then OpenAI's frequency and
    presence penalties over the response so far, by hand."""
    raw = response_logits(model, prompt, response)
    processor = RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty)
    rows = []
    for i in range(len(response)):
        scores = processor(torch.tensor([prompt + response[:i]]), raw[i : i + 1].clone())[0]
        for token, count in Counter(response[:i]).items():
            scores[token] -= sampling.frequency_penalty * count + sampling.presence_penalty
        rows.append(scores)
    return torch.stack(rows)


def test_penalties_match_transformers_and_openai_formulas(engine, model):
    """Greedy and sampled rows with penalties, batched with rows without (more requests than
    batch rows: rows join and leave while others decode): the penalized rows' tokens and
    logprobs follow the reference, the others are as if run alone."""
    penalties = [
        dict(repetition_penalty=1.8),
        dict(frequency_penalty=1.5, presence_penalty=0.5),
        dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=2.0),
    ]
    requests = []
    for i, prompt in enumerate(PROMPTS[:3]):
        for j, temperature in enumerate((0.0, 0.9)):
            sampling = SamplingParams(
                temperature=temperature, max_new_tokens=12 - 3 * j, **penalties[i]
            )
            requests.append(GenerateRequest(10 * i + j, prompt, sampling))
    plain = [GenerateRequest(100 + i, p, SamplingParams(temperature=0.0)) for i, p in
             enumerate(PROMPTS)]  # fmt: skip
    results = run(engine, requests + plain)
    alone = run(engine, plain)
    changed = 0
    for req in requests:
        res = results[req.request_id]
        ref = penalized_reference(model, req.prompt_ids, res.response_ids, req.sampling)
        logprobs = torch.log_softmax(ref / temperature_of(req.sampling), dim=-1)
        chosen = as_ids(res.response_ids)
        torch.testing.assert_close(
            torch.tensor(res.logprobs), logprobs[torch.arange(len(chosen)), chosen], atol=ATOL,
            rtol=0,
        )  # fmt: skip
        if req.sampling.temperature == 0:
            assert res.response_ids == ref.argmax(dim=-1).tolist()
            raw = response_logits(model, req.prompt_ids, res.response_ids)
            changed += raw.argmax(dim=-1).tolist() != res.response_ids
    assert changed >= 2  # the penalties did change greedy choices
    for req in plain:
        assert results[req.request_id].response_ids == alone[req.request_id].response_ids
        torch.testing.assert_close(
            results[req.request_id].logprobs, alone[req.request_id].logprobs, atol=ATOL, rtol=0
        )


# ── stop_regex ──────────────────────────────────────────────────────────────────────────────────


def test_stop_regex_stops_at_the_first_match(engine):
    decode = engine.tokenizer.decode
    [full] = run(engine, requests_for(PROMPTS[:1], temperature=0.0, max_new_tokens=16)).values()
    text = decode(full.response_ids)
    # A match that first completes in the middle of the text and spans it from its start (a
    # search of the newest tokens' text alone would miss it).
    middle = len(text) // 2
    pattern = f"^{re.escape(text[0])}.*{re.escape(text[middle])}.{re.escape(text[middle + 2])}"
    cut = next(
        n for n in range(1, 17) if re.search(pattern, decode(full.response_ids[:n])) is not None
    )
    assert cut < len(full.response_ids)
    [res] = run(
        engine,
        requests_for(PROMPTS[:1], temperature=0.0, max_new_tokens=16, stop_regex=("^$x", pattern)),
    ).values()
    assert res.response_ids == full.response_ids[:cut] and res.finish_reason == "stop"
    [never] = run(
        engine, requests_for(PROMPTS[:1], temperature=0.0, max_new_tokens=16, stop_regex=("^$x",))
    ).values()
    assert never.response_ids == full.response_ids and never.finish_reason == full.finish_reason
    with pytest.raises(ValueError, match="stop_regex"):
        engine.generate(requests_for(PROMPTS[:1], stop_regex=("(unclosed",)))


# ── top and prompt logprobs ─────────────────────────────────────────────────────────────────────


def assert_top_matches(top, logprobs: torch.Tensor, k: int) -> None:
    """`top` (pairs) are the k most likely of `logprobs` [vocab], most likely first."""
    values, ids = logprobs.topk(k)
    assert [t for t, _ in top] == ids.tolist()
    torch.testing.assert_close(torch.tensor([v for _, v in top]), values, atol=ATOL, rtol=0)


def test_top_logprobs_and_prompt_logprobs_match_a_plain_forward(engine, model):
    def sampling(**fields):
        return SamplingParams(**{"max_new_tokens": 8, **fields})

    requests = [
        GenerateRequest(0, PROMPTS[0], sampling(temperature=0.0, top_logprobs=5)),
        GenerateRequest(
            1, PROMPTS[1], sampling(temperature=0.7, top_logprobs=3, prompt_logprobs=True)
        ),
        GenerateRequest(2, PROMPTS[2], sampling(temperature=1.0, prompt_logprobs=True)),
        # Prompt logprobs alone (/v1/score, echo): the model runs, nothing is sampled.
        GenerateRequest(
            3, PROMPTS[1], sampling(max_new_tokens=0, prompt_logprobs=True, top_logprobs=2)
        ),
        # ignore_eos: its 8 tokens whatever the sampler's random stream draws (CPU and CUDA).
        GenerateRequest(
            4, PROMPTS[3], sampling(prompt_logprobs=True, top_logprobs=1, ignore_eos=True)
        ),
        GenerateRequest(5, PROMPTS[2], sampling(temperature=0.5)),
    ]
    results = run(engine, requests)
    for req in requests:
        res, sampling = results[req.request_id], req.sampling
        all_logits = logits_of(model, req.prompt_ids + res.response_ids)
        n = len(req.prompt_ids)
        response = torch.log_softmax(all_logits[n - 1 : -1] / temperature_of(sampling), dim=-1)
        chosen = response[torch.arange(len(res.response_ids)), as_ids(res.response_ids)]
        torch.testing.assert_close(torch.tensor(res.logprobs), chosen, atol=ATOL, rtol=0)
        if sampling.top_logprobs:
            assert res.top_logprobs is not None
            assert len(res.top_logprobs) == len(res.response_ids)
            for top, row in zip(res.top_logprobs, response, strict=True):
                assert_top_matches(top, row, sampling.top_logprobs)
        else:
            assert res.top_logprobs is None
        if not sampling.prompt_logprobs:
            assert res.prompt_logprobs is None and res.prompt_top_logprobs is None
            continue
        prompt = torch.log_softmax(all_logits[: n - 1], dim=-1)  # raw: temperature 1
        targets = as_ids(req.prompt_ids[1:])
        assert res.prompt_logprobs is not None and len(res.prompt_logprobs) == n - 1
        expected = prompt[torch.arange(n - 1), targets]
        torch.testing.assert_close(torch.tensor(res.prompt_logprobs), expected, atol=ATOL, rtol=0)
        if sampling.top_logprobs:
            assert res.prompt_top_logprobs is not None and len(res.prompt_top_logprobs) == n - 1
            for top, row in zip(res.prompt_top_logprobs, prompt, strict=True):
                assert_top_matches(top, row, sampling.top_logprobs)
        else:
            assert res.prompt_top_logprobs is None
    assert results[3].response_ids == [] and results[3].finish_reason == "length"
    assert results[4].prompt_logprobs == [] and len(results[4].response_ids) == 8
    with pytest.raises(ValueError, match="top_logprobs"):
        engine.generate(requests_for(PROMPTS[:1], top_logprobs=21))


def test_prompt_logprobs_compute_every_position_whatever_the_prefix_cache_holds(engine, model):
    prompt = PROMPTS[1]  # 30 tokens: several pages, prefilled in chunks on the paged path
    plain = SamplingParams(temperature=0.0, max_new_tokens=2)
    asks = SamplingParams(temperature=0.0, max_new_tokens=2, prompt_logprobs=True)
    run(engine, [GenerateRequest(0, prompt, plain)])  # the prompt's pages are cached now
    # One that asks, after the prompt was cached and beside a sample of the same prompt.
    results = run(engine, [GenerateRequest(1, prompt, plain), GenerateRequest(2, prompt, asks)])
    again = run(engine, [GenerateRequest(3, prompt, plain)])[3]
    expected = torch.log_softmax(logits_of(model, prompt)[:-1], dim=-1)
    expected = expected[torch.arange(len(prompt) - 1), as_ids(prompt[1:])]
    got = results[2].prompt_logprobs
    assert got is not None and len(got) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(got), expected, atol=ATOL, rtol=0)
    assert results[2].cached_tokens == 0
    assert results[2].response_ids == results[1].response_ids
    if engine.path == "paged":  # the others still find the prompt cached
        assert results[1].cached_tokens > 0 and again.cached_tokens > 0


# ── logit_bias and cache_salt ───────────────────────────────────────────────────────────────────


def test_logit_bias_shifts_the_distribution_sampled_and_reported(engine, model):
    """Greedy with a +bias on the plain answer's second choice takes it, and the reported
    logprobs are of the biased distribution (as SGLang's): log_softmax(logits + bias)."""
    prompt = PROMPTS[0]
    plain = run(engine, requests_for([prompt], temperature=0.0, max_new_tokens=1))[0]
    first = logits_of(model, prompt)[-1]
    runner_up = int(torch.topk(first, 2).indices[1])
    assert plain.response_ids == [int(first.argmax())]
    bias = float(first.max() - first[runner_up]) + 1.0
    params = SamplingParams(temperature=0.0, max_new_tokens=1, logit_bias=((runner_up, bias),))
    (got,) = engine.results([GenerateRequest(7, prompt, params)])
    assert got.response_ids == [runner_up]
    biased = first.clone()
    biased[runner_up] += bias
    expected = torch.log_softmax(biased, dim=-1)[runner_up].item()
    assert got.logprobs[0] == pytest.approx(expected, abs=ATOL)


def test_cache_salt_keeps_differently_salted_prefixes_apart(engine):
    """A prompt cached under one salt is a hit for that salt only; the answers stay the same."""
    prompt = list(range(89, 59, -1))  # 30 tokens, seen by no other test
    params = SamplingParams(temperature=0.0, max_new_tokens=3)

    def once(request_id: int, salt: str | None):
        (result,) = engine.results([GenerateRequest(request_id, prompt, params, salt)])
        return result

    runs = [once(i, salt) for i, salt in enumerate(["a", "a", "b", None, None])]
    cached = [r.cached_tokens for r in runs]
    if engine.path == "paged":
        assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0 and cached[3] == 0
        assert cached[4] == cached[1]
    else:  # the hf loop has no prefix cache
        assert cached == [0] * 5
    assert all(r.response_ids == runs[0].response_ids for r in runs)


# ── constraints ─────────────────────────────────────────────────────────────────────────────────


def set_bit(bitmask: np.ndarray, row: int, token: int) -> None:
    bitmask.view(np.uint32)[row, token // 32] |= np.uint32(1 << (token % 32))


class Only:
    """Allows exactly `tokens`, one after the other; finished after the last."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.accepted = tokens, []

    def fill_bitmask(self, bitmask, row):
        set_bit(bitmask, row, self.tokens[len(self.accepted)])

    def accept(self, token_id):
        self.accepted.append(token_id)

    def is_finished(self):
        return len(self.accepted) == len(self.tokens)


class Even:
    """Allows the even token ids; never finished."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def fill_bitmask(self, bitmask, row):
        bitmask.view(np.uint32)[row] = 0x55555555  # bits 0, 2, 4, ...

    def accept(self, token_id):
        self.accepted.append(token_id)

    def is_finished(self):
        return False


def test_constraints_force_the_allowed_tokens(engine, model):
    """A constraint's row draws only allowed tokens, from the masked distribution (logprobs and
    top logprobs are of it); its constraint sees every token; a finished one stops the row;
    rows without constraint are as if run alone."""
    forced = [31, 127, 64, 3, 95]  # bit 31 of a word (the int32 sign bit), the last id
    only, even = Only(forced), Even()
    requests = [
        GenerateRequest(0, PROMPTS[0], SamplingParams(temperature=1.5, constraint=only)),
        GenerateRequest(  # eos (2) is even: ignored, so that the row runs to its length
            1,
            PROMPTS[1],
            SamplingParams(
                temperature=1.3, max_new_tokens=10, top_logprobs=4, constraint=even, ignore_eos=True
            ),
        ),
        GenerateRequest(2, PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=10)),
    ]
    results = run(engine, requests)
    alone = run(engine, [requests[2]])[2]
    assert results[0].response_ids == forced == only.accepted
    assert results[0].finish_reason == "stop"
    torch.testing.assert_close(results[0].logprobs, [0.0] * len(forced), atol=1e-6, rtol=0)
    res = results[1]
    assert len(res.response_ids) == 10 and res.finish_reason == "length"
    assert all(t % 2 == 0 for t in res.response_ids) and even.accepted == res.response_ids
    logits = response_logits(model, PROMPTS[1], res.response_ids)
    logits[:, 1::2] = -torch.inf
    masked = torch.log_softmax(logits / 1.3, dim=-1)
    chosen = masked[torch.arange(10), as_ids(res.response_ids)]
    torch.testing.assert_close(torch.tensor(res.logprobs), chosen, atol=ATOL, rtol=0)
    assert res.top_logprobs is not None
    for top, row in zip(res.top_logprobs, masked, strict=True):
        assert_top_matches(top, row, 4)
    assert results[2].response_ids == alone.response_ids


# ── units ───────────────────────────────────────────────────────────────────────────────────────


def test_bitmask_unpacking_and_the_vocabulary_past_the_bitmask():
    g = np.random.default_rng(0)
    words = g.integers(-(2**31), 2**31, size=(3, 4), dtype=np.int64).astype(np.int32)
    words[0, 0] = -1  # every bit, the sign bit included
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool)
    unpacked = unpack_bitmask(torch.from_numpy(words), 160)  # a padded model vocabulary
    assert unpacked.shape == (3, 160)
    assert (unpacked[:, :128].numpy() == bits).all() and not unpacked[:, 128:].any()
    assert (unpack_bitmask(torch.from_numpy(words), 100).numpy() == bits[:, :100]).all()

    class Everything:
        def fill_bitmask(self, bitmask, row):
            bitmask[row] = -1

    class Row:
        def __init__(self, sampling):
            self.request = GenerateRequest(0, [1], sampling)
            self.response: list[int] = []
            self.done = False

    rows = [Row(SamplingParams(constraint=Everything())), Row(SamplingParams())]
    params = SamplingTensors.from_params([r.request.sampling for r in rows], torch.device("cpu"))
    logits = torch.randn(2, 160)
    out = LogitsProcessor(constraint_vocab=99)(logits, rows, params)  # 4 words: 128 tokens
    assert torch.equal(out[0, :128], logits[0, :128]) and (out[0, 128:] == -torch.inf).all()
    assert torch.equal(out[1], logits[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_constrained_batch_whose_first_logits_are_all_masked_samples_finite_logprobs():
    """The fused kernel's online softmax takes no all -inf block of logits: such batches take
    the torch path."""
    from miles.torch.engine.sampler import sample

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn((4, 10_000), generator=g, device="cuda")
    logits[:, :8192] = -torch.inf  # two whole blocks of the kernel
    sampling = [SamplingParams(temperature=t, constraint=Even()) for t in (0.0, 1.0, 1.0, 0.7)]
    params = SamplingTensors.from_params(sampling, torch.device("cuda"))
    tokens, logprobs = sample(logits, params, g)
    assert (tokens >= 8192).all() and torch.isfinite(logprobs).all()
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.7], device="cuda").unsqueeze(1)
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, tokens.unsqueeze(1))
    torch.testing.assert_close(logprobs, expected.squeeze(1), atol=1e-5, rtol=0)


def test_the_new_flags_are_off_for_default_params():
    params = SamplingTensors.from_params([SamplingParams()] * 2, torch.device("cpu"))
    assert not (params.penalized or params.constrained or params.top_logprobs)
    assert SamplingParams(presence_penalty=0.1).penalized
