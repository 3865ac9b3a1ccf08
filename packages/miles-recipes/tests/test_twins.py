"""Every family's tiny twin: written as a checkpoint, loaded the way Miles loads it, and served by
the native rollout engine with logprobs equal to transformers' own forward on that checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from miles.core.contracts.components import Kind
from miles.core.contracts.types import GenerateRequest, SamplingParams
from miles.core.registry.plugins import get_plugin_manager
from miles.recipes.twins import write_twin
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.models import load_causal_lm

MANAGER = get_plugin_manager()
FAMILIES = [
    name
    for name in MANAGER.registry.names(Kind.FAMILY)
    if MANAGER.get(Kind.FAMILY, name).spec.factory().tiny is not None
]


@pytest.fixture(scope="module", params=FAMILIES)
def twin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.set_num_threads(1)
    path = write_twin(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    return request.param, path


def test_twin_is_written_bitwise_reproducibly(twin: Any, tmp_path: Path) -> None:
    name, path = twin
    again = write_twin(name, tmp_path, seed=3)
    first = (Path(path) / "model.safetensors").read_bytes()
    assert (Path(again) / "model.safetensors").read_bytes() == first


def test_engine_logprobs_match_transformers_forward(twin: Any) -> None:
    name, path = twin
    engine = TorchRolloutEngine(path, max_batch_size=2, seed=0)
    # Different lengths (left padding) and more requests than slots (rows finish and new ones
    # are merged into the running batch).
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [7, 7, 8, 9, 20], [4, 21]]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    requests = [
        GenerateRequest(request_id=i, prompt_ids=p, sampling=sampling)
        for i, p in enumerate(prompts)
    ]
    results = {r.request_id: r for r in engine.results(requests)}
    reference = load_causal_lm(path, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        result = results[i]
        assert result.response_ids, (name, i)
        ids = torch.tensor([prompt + result.response_ids])
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        n = len(prompt)
        expected = [float(logprobs[n - 1 + t, tok]) for t, tok in enumerate(result.response_ids)]
        assert result.logprobs == pytest.approx(expected, abs=1e-4), (name, i)
