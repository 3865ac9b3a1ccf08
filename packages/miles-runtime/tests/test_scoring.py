"""Reward failures mark samples, never crash a run, unless reward.on_error: fail."""

from __future__ import annotations

import asyncio
import math

import pytest

from miles.core.contracts.types import Sample, SampleStatus
from miles.runtime.rollout.scoring import RewardError, RewardScorer


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


async def _picky(response: str, sample: Sample) -> float:
    if response == "1":
        raise RuntimeError("cannot score 1")
    if response == "2":
        return math.nan
    if response == "3":
        await asyncio.sleep(10)
    return float(len(response))


def _group() -> list[Sample]:
    return [Sample(prompt_ids=[0], response_ids=[i], sample_id=i) for i in (1, 2, 3, 44)]


def test_failures_are_recorded_per_sample() -> None:
    group = _group()
    scorer = RewardScorer(_picky, "picky", _Tok(), on_error="mark_failed", timeout_s=0.2)
    asyncio.run(scorer.score(group))
    raised, nan, slow, ok = group
    assert raised.status is SampleStatus.FAILED and "cannot score 1" in (raised.error or "")
    assert nan.status is SampleStatus.FAILED and "nan" in (nan.error or "")
    assert slow.status is SampleStatus.FAILED and "timeout_s=0.2" in (slow.error or "")
    assert ok.status is SampleStatus.COMPLETED and ok.reward == 2.0
    assert all(s.metadata.get("reward_error") for s in (raised, nan, slow))


def test_on_error_fail_stops_with_the_fix_named() -> None:
    scorer = RewardScorer(_picky, "picky", _Tok(), on_error="fail", timeout_s=None)
    with pytest.raises(RewardError, match=r"reward\.on_error: mark_failed"):
        asyncio.run(scorer.score(_group()[:1]))


class _Batched:
    calls = 0

    async def score_group(self, responses: list[str], samples: list[Sample]) -> list[float]:
        type(self).calls += 1
        return [float(r == "44") for r in responses]

    async def __call__(self, response: str, sample: Sample) -> float:
        raise AssertionError("a group reward is scored per group")


def test_group_rewards_score_once_per_group() -> None:
    group = [Sample(prompt_ids=[0], response_ids=[i]) for i in (44, 5)]
    asyncio.run(
        RewardScorer(_Batched(), "b", _Tok(), groups=True, on_error="fail", timeout_s=1).score(
            group
        )
    )
    assert [s.reward for s in group] == [1.0, 0.0] and _Batched.calls == 1
