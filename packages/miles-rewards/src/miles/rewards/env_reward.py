"""`env`: the reward a multi-turn environment accumulated over the episode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from miles.core.contracts.types import Sample


@dataclass
class EnvRewardConfig:
    pass


class EnvReward:
    deterministic = True
    reward_range = (float("-inf"), float("inf"))
    # What a multi-turn episode leaves on the sample (see miles.plugin_kit.conformance).
    conformance_example: ClassVar[dict[str, Any]] = {"row": {"env_reward": 1.0}}

    def __init__(self, config: EnvRewardConfig) -> None:
        self.config = config

    async def __call__(self, response: str, sample: Sample) -> float:
        if "env_reward" not in sample.metadata:
            raise KeyError(
                "no env_reward on this sample: use rollout.function multi_turn, or agent with "
                "an agent that returns a reward"
            )
        return float(sample.metadata["env_reward"])
