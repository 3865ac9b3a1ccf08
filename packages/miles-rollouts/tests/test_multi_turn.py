"""multi_turn on a real tiny Qwen3 and the native engine: tokens and masks come out right."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from miles.core.contracts.protocols import EnvStep, PromptGroup
from miles.core.contracts.types import GenerateRequest, GenerateResult, SamplingParams
from miles.rollouts.environments import Calculator, CalculatorConfig, safe_arithmetic
from miles.rollouts.multi_turn import MultiTurn, MultiTurnConfig


class _Ctx:
    """The rollout context over one in-process engine."""

    def __init__(self, engine: Any, sampling: SamplingParams) -> None:
        self.engine, self.sampling, self.tokenizer = engine, sampling, engine.tokenizer

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return list(self.engine.results(requests))


class _Scripted:
    """Answers the first action with an observation, ends the episode on the second."""

    def __init__(self) -> None:
        self.actions: list[str] = []

    async def reset(self, row: dict[str, Any]) -> EnvStep:
        return EnvStep("")

    async def step(self, action: str) -> EnvStep:
        self.actions.append(action)
        return EnvStep("42", reward=0.5, done=len(self.actions) == 2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from miles.torch.engine.engine import TorchRolloutEngine
    from miles.torch.testing import make_tiny_model

    path = make_tiny_model(Path(tmp_path_factory.mktemp("m")), arch="qwen3", seed=1)
    return TorchRolloutEngine(path, seed=0)


def test_turns_observations_masks_and_logprobs(engine: Any) -> None:
    rollout = MultiTurn(MultiTurnConfig(max_turns=4, max_turn_tokens=6, turn_stop=[]))
    env = _Scripted()
    rollout._env = lambda: env  # type: ignore[method-assign]
    ctx = _Ctx(engine, SamplingParams(temperature=1.0, max_new_tokens=40))
    prompt = engine.tokenizer.encode("hello", add_special_tokens=False)
    group = PromptGroup(group_id=0, prompt_ids=prompt, row={"q": 1}, sample_ids=[7])
    (sample,) = asyncio.run(rollout(ctx, group))

    obs = engine.tokenizer.encode("\n<result>42</result>\n", add_special_tokens=False)
    mask = sample.loss_mask
    # turn 1 (trained), the observation (not trained), turn 2 (trained)
    first = mask.index(0)
    assert mask[first : first + len(obs)] == [0] * len(obs)
    assert sample.response_ids[first : first + len(obs)] == obs
    assert all(m == 1 for m in mask[:first]) and all(m == 1 for m in mask[first + len(obs) :])
    assert len(env.actions) == 2 and sample.metadata["env_reward"] == 1.0
    assert sample.metadata["turns"] == 2 and sample.sample_id == 7

    # Tokens in, tokens out: a teacher-forced forward over exactly these tokens gives the engine's
    # logprobs for every model token, so nothing was re-tokenized between turns.
    ids = torch.tensor([prompt + sample.response_ids])
    with torch.no_grad():
        logits = engine.model(ids).logits[0].float()
    logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    tail = logp[len(prompt) - 1 :]
    for i, trained in enumerate(mask):
        if trained:
            assert abs(tail[i].item() - sample.rollout_logprobs[i]) < 1e-4
        else:
            assert sample.rollout_logprobs[i] == 0.0


def test_calculator_environment() -> None:
    env = Calculator(CalculatorConfig())
    asyncio.run(env.reset({"answer": "14"}))
    assert asyncio.run(env.step("let me <calc>2*(3+4)</calc>")).observation == "14"
    assert "error" in asyncio.run(env.step("<calc>__import__('os')</calc>")).observation
    done = asyncio.run(env.step("<answer>14</answer>"))
    assert done.done and done.reward == 1.0
    assert safe_arithmetic("1/4") == 0.25
    with pytest.raises(ValueError):
        safe_arithmetic("2**1000")


def test_unknown_environment_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="unknown environment 'calculater'; did you mean"):
        MultiTurnConfig(env="calculater")
