import asyncio

from miles_reward_example.plugin import KeywordConfig, KeywordReward

from miles.core.contracts.types import Sample


def test_keyword_reward_scores_presence() -> None:
    reward = KeywordReward(KeywordConfig(keywords=["because", "so"]))
    sample = Sample(prompt_ids=[1])
    assert asyncio.run(reward("It fell BECAUSE of gravity, so", sample)) == 1.0
    assert asyncio.run(reward("It fell.", sample)) == 0.0
