"""Sampling: top-k / top-p / temperature, stop conditions and seeded determinism."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.engine.loader import eos_token_ids
from miles.torch.engine.sampler import SamplingTensors, sample

torch.set_num_threads(1)


def run(engine, prompts, **sampling):
    params = SamplingParams(**{"max_new_tokens": 16, **sampling})
    requests = [GenerateRequest(i, p, params) for i, p in enumerate(prompts)]
    return sorted(engine.results(requests), key=lambda r: r.request_id)


PROMPTS = [[5, 6, 7, 8], [40, 41], [90, 12, 13, 14, 15, 16, 17], [33]]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TorchRolloutEngine(tiny_model("qwen3"), seed=0)


@pytest.fixture(scope="module")
def greedy(engine):
    return run(engine, PROMPTS, temperature=0.0)


def test_sampler_distribution_follows_top_k_and_top_p():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])
    logits = probs.log().expand(40_000, -1)
    gen = torch.Generator().manual_seed(0)
    cases = {  # (temperature, top_k, top_p) -> expected distribution
        (1.0, -1, 1.0): probs,
        (1.0, 2, 1.0): torch.tensor([0.625, 0.375, 0, 0, 0]),
        # Mass before token 2 is 0.8 >= 0.7, so top-p keeps tokens 0 and 1.
        (1.0, -1, 0.7): torch.tensor([0.625, 0.375, 0, 0, 0]),
        # top-p over the top-3 renormalised (0.556, 0.333, 0.111): keeps 0 and 1.
        (1.0, 3, 0.85): torch.tensor([0.625, 0.375, 0, 0, 0]),
        (0.5, -1, 1.0): probs**2 / (probs**2).sum(),
    }
    for (temperature, top_k, top_p), want in cases.items():
        params = SamplingTensors.from_params(
            [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * len(logits),
            torch.device("cpu"),
        )
        tokens, logprobs = sample(logits, params, gen)
        freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
        torch.testing.assert_close(freq, want, rtol=0, atol=0.01)
        # Logprobs are always of the unfiltered, temperature-scaled distribution.
        unfiltered = torch.log_softmax(logits[0] / temperature, dim=-1)
        torch.testing.assert_close(logprobs, unfiltered[tokens], rtol=0, atol=1e-6)


def test_sampler_mixes_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    params = SamplingTensors.from_params(
        [SamplingParams(temperature=0.0), SamplingParams(temperature=100.0)], torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample(logits, params, gen)[0] for _ in range(200)])
    assert (draws[:, 0] == 1).all()  # greedy row: always the argmax
    assert len(draws[:, 1].unique()) == 3  # near-uniform row: everything shows up


def test_top_k_1_and_tiny_top_p_equal_greedy(engine, greedy):
    for sampling in (dict(temperature=0.7, top_k=1), dict(temperature=1.0, top_p=1e-6)):
        sampled = run(engine, PROMPTS, **sampling)
        assert [r.response_ids for r in sampled] == [r.response_ids for r in greedy]
    # With T = 1 the logprobs are the greedy ones too (the top-p filter does not change them).
    for s, g in zip(sampled, greedy, strict=True):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(g.logprobs))


def test_max_new_tokens_gives_length(engine, greedy):
    for r in greedy:
        assert r.finish_reason in {"stop", "length"}
        if r.finish_reason == "length":
            assert len(r.response_ids) == 16
    assert any(r.finish_reason == "length" for r in greedy)


def test_stop_token_ids(engine, greedy):
    full = max(greedy, key=lambda r: len(r.response_ids)).response_ids
    stop = full[3]
    cut = full.index(stop) + 1
    prompt = PROMPTS[max(range(len(greedy)), key=lambda i: len(greedy[i].response_ids))]
    [res] = run(engine, [prompt], temperature=0.0, stop_token_ids=(stop,))
    assert res.response_ids == full[:cut]  # the stop token stays in the response
    assert res.finish_reason == "stop"


def test_generation_config_eos_stops(tiny_model, greedy, tmp_path):
    """eos from the checkpoint (generation_config.json) ends sequences like stop_token_ids."""
    full = greedy[0].response_ids
    path = Path(shutil.copytree(tiny_model("qwen3"), tmp_path / "model"))
    config = json.loads((path / "generation_config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], full[2]]
    (path / "generation_config.json").write_text(json.dumps(config))
    engine = TorchRolloutEngine(str(path))
    [res] = run(engine, PROMPTS[:1], temperature=0.0)
    assert res.response_ids == full[: full.index(full[2]) + 1]
    assert res.finish_reason == "stop"
    assert eos_token_ids(engine.model, engine.tokenizer) == {engine.tokenizer.eos_token_id, full[2]}


def test_stop_strings(engine, greedy):
    res = max(greedy, key=lambda r: len(r.response_ids))
    prompt = PROMPTS[greedy.index(res)]
    decode = engine.tokenizer.decode
    stop_string = decode(res.response_ids[4:6])
    # The first prefix whose text contains the stop string is where generation must end.
    cut = next(n for n in range(1, 17) if stop_string in decode(res.response_ids[:n]))
    [got] = run(engine, [prompt], temperature=0.0, stop_strings=("never-appears", stop_string))
    assert got.response_ids == res.response_ids[:cut]
    assert got.finish_reason == "stop"
    assert stop_string in decode(got.response_ids)
    assert stop_string not in decode(got.response_ids[:-1])


def test_seeded_sampling_is_deterministic(tiny_model):
    path = tiny_model("qwen3")

    def sample_with(seed):
        engine = TorchRolloutEngine(path, seed=seed, max_batch_size=2)
        return [r.response_ids for r in run(engine, PROMPTS, temperature=1.0, top_p=0.95)]

    assert sample_with(3) == sample_with(3)
    assert sample_with(3) != sample_with(4)
