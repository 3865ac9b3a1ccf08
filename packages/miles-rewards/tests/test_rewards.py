import asyncio

import pytest

from miles.core.contracts.types import Sample, SampleStatus
from miles.rewards.exact_match import ExactMatch, ExactMatchConfig
from miles.rewards.filters import DropFailed, DropFailedConfig


def test_exact_match() -> None:
    reward = ExactMatch(ExactMatchConfig())
    sample = Sample(prompt_ids=[1], metadata={"answer": "7"})
    assert asyncio.run(reward(" 7\n", sample)) == 1.0
    assert asyncio.run(reward("17", sample)) == 0.0
    strict = ExactMatch(ExactMatchConfig(strip=False))
    assert asyncio.run(strict(" 7", sample)) == 0.0


def test_exact_match_missing_field_names_the_fix() -> None:
    reward = ExactMatch(ExactMatchConfig(answer_key="label"))
    with pytest.raises(KeyError, match=r"reward\.answer_key"):
        asyncio.run(reward("7", Sample(prompt_ids=[1], metadata={"answer": "7"})))


def test_drop_failed() -> None:
    ok, bad = Sample(prompt_ids=[1]), Sample(prompt_ids=[1], status=SampleStatus.FAILED)
    assert DropFailed(DropFailedConfig())([ok, bad]) == [ok]
