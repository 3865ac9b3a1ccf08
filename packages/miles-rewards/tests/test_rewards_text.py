"""`format` and `overlong`, plus the conformance attributes and config checks of every reward."""

import asyncio
import itertools

import pytest

from miles.core.contracts.types import Sample
from miles.rewards.configs import (
    CountdownConfig,
    FormatConfig,
    LLMJudgeConfig,
    OverlongConfig,
    RemoteRMConfig,
)
from miles.rewards.countdown import Countdown
from miles.rewards.format import Format
from miles.rewards.gsm8k import GSM8K
from miles.rewards.llm_judge import LLMJudge
from miles.rewards.math import MathVerify
from miles.rewards.overlong import Overlong, overlong_penalty
from miles.rewards.remote_rm import RemoteRM


def run(reward, response: str, sample: Sample | None = None) -> float:
    return asyncio.run(reward(response, sample or Sample(prompt_ids=[1])))


# ── format ───────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("response", "strict", "lenient"),
    [
        ("<think>a</think><answer>b</answer>", 1.0, 1.0),
        ("\n<think>\nmulti\nline\n</think>\n\n<answer> 42 </answer>\n", 1.0, 1.0),
        ("<think></think><answer></answer>", 1.0, 1.0),
        ("<answer>b</answer><think>a</think>", 0.0, 0.0),  # wrong order
        ("<think>a</think>", 0.0, 0.0),  # no answer
        ("<think>a<answer>b</answer>", 0.0, 0.0),  # unclosed think
        ("Sure! <think>a</think><answer>b</answer>", 0.0, 1.0),  # text outside
        ("<think>a</think>so<answer>b</answer>", 0.0, 1.0),  # text between
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0, 1.0),  # twice
        ("<think>a<think>b</think></think><answer>c</answer>", 0.0, 1.0),  # nested
        ("<think>a</think><answer>b</answer>.", 0.0, 1.0),
    ],
)
def test_format(response: str, strict: float, lenient: float) -> None:
    assert run(Format(FormatConfig(strict=True)), response) == strict
    assert run(Format(FormatConfig(strict=False)), response) == lenient


def test_format_custom_tags() -> None:
    reward = Format(FormatConfig(tags=["answer"]))
    assert run(reward, "  <answer>7</answer>") == 1.0
    assert run(reward, "<think>a</think><answer>7</answer>") == 0.0
    with pytest.raises(ValueError, match="tags"):
        FormatConfig(tags=["a>b"])
    with pytest.raises(ValueError, match="at least one"):
        FormatConfig(tags=[])


# ── overlong (DAPO) ──────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (15, -0.75), (16, -1.0), (17, -1.0), (99, -1.0)],
)
def test_overlong_boundaries(length: int, expected: float) -> None:
    # max_len 16, buffer 4: free up to 12 tokens, a linear ramp to -1 at 16, -1 past it.
    reward = Overlong(OverlongConfig(max_len=16, buffer=4))
    sample = Sample(prompt_ids=[1, 2, 3], response_ids=list(range(length)))
    assert run(reward, "text is ignored", sample) == pytest.approx(expected)


def test_overlong_penalty_is_continuous_and_monotone() -> None:
    values = [overlong_penalty(n, 4096, 512) for n in range(3500, 4200)]
    assert all(a >= b for a, b in itertools.pairwise(values))
    assert overlong_penalty(4096 - 512, 4096, 512) == 0.0
    assert overlong_penalty(4096, 4096, 512) == -1.0
    assert overlong_penalty(4097, 4096, 512) == -1.0


def test_overlong_config_checks() -> None:
    with pytest.raises(ValueError, match="buffer"):
        OverlongConfig(max_len=8, buffer=0)
    with pytest.raises(ValueError, match="buffer"):
        OverlongConfig(max_len=8, buffer=9)
    OverlongConfig(max_len=8, buffer=8)  # the whole budget as ramp is allowed


# ── conformance attributes ───────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("cls", "deterministic"),
    [
        (MathVerify, True),
        (GSM8K, True),
        (Countdown, True),
        (Format, True),
        (Overlong, True),
        (RemoteRM, False),
        (LLMJudge, False),
    ],
)
def test_reward_declares_range_and_determinism(cls: type, deterministic: bool) -> None:
    low, high = cls.reward_range
    assert low < high
    assert cls.deterministic is deterministic
    assert hasattr(cls, "score_group") == (cls in (RemoteRM, LLMJudge))


def test_countdown_scores_stay_in_range() -> None:
    reward = Countdown(CountdownConfig(format_score=0.1))
    sample = Sample(prompt_ids=[1], metadata={"target": 3, "numbers": [1, 2]})
    for text in ["<answer>1 + 2</answer>", "<answer>1 * 2</answer>", "<answer>x</answer>", ""]:
        low, high = Countdown.reward_range
        assert low <= run(reward, text, sample) <= high


def test_http_config_checks() -> None:
    with pytest.raises(ValueError, match="url"):
        RemoteRMConfig(url="localhost:5000")
    with pytest.raises(ValueError, match="batch_size"):
        RemoteRMConfig(url="http://h/x", batch_size=0)
    with pytest.raises(ValueError, match="backoff"):
        RemoteRMConfig(url="http://h/x", backoff_s=2, backoff_max_s=1)
    with pytest.raises(ValueError, match="score_max"):
        LLMJudgeConfig(base_url="http://h/v1", model="m", score_min=1, score_max=1)
    with pytest.raises(ValueError, match="placeholders"):
        LLMJudge(LLMJudgeConfig(base_url="http://h/v1", model="m", prompt_template="{question}"))
    with pytest.raises(ValueError, match="placeholders"):
        RemoteRM(RemoteRMConfig(url="http://h/x", query_template="{prompt}{label}"))
    with pytest.raises(ValueError, match="capture group"):
        LLMJudge(LLMJudgeConfig(base_url="http://h/v1", model="m", score_pattern=r"\d+"))
