"""The engine's sampling RNG state survives a round trip, so a resumed run samples what an
uninterrupted one would have."""

import base64

import pytest
import torch

from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.torch.engine.engine import TorchRolloutEngine

torch.set_num_threads(1)

PROMPTS = [[5, 6, 7, 8], [40, 41], [90, 12, 13]]


def sample(engine: TorchRolloutEngine) -> list[list[int]]:
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    requests = [GenerateRequest(i, p, params) for i, p in enumerate(PROMPTS)]
    results = sorted(engine.results(requests), key=lambda r: r.request_id)
    return [r.response_ids for r in results]


@pytest.fixture(scope="module")
def engine(tiny_model):
    return TorchRolloutEngine(tiny_model("qwen3"), seed=0)


def test_restored_state_replays_the_same_samples(engine):
    sample(engine)  # move the generator away from its seed first
    state = engine.get_rng_state()
    assert isinstance(state, str)
    first = sample(engine)
    second = sample(engine)  # no restore: the generator moved on
    assert second != first
    engine.set_rng_state(state)
    assert engine.get_rng_state() == state
    assert sample(engine) == first


def test_state_moves_to_a_fresh_engine(engine, tiny_model):
    # What a resume does: a new engine (other seed) takes the checkpointed state.
    state = engine.get_rng_state()
    expected = sample(engine)
    fresh = TorchRolloutEngine(tiny_model("qwen3"), seed=123)
    fresh.set_rng_state(state)
    assert sample(fresh) == expected


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ("not base64 !!", "not valid base64"),
        (base64.b64encode(b"\x00" * 16).decode(), "has 16 bytes"),
        ("", "has 0 bytes"),
        ("é", "not valid base64"),
    ],
)
def test_malformed_state_is_rejected(engine, state, match):
    before = engine.get_rng_state()
    with pytest.raises(ValueError, match=match):
        engine.set_rng_state(state)
    assert engine.get_rng_state() == before
