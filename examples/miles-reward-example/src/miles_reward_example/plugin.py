"""Registers one reward, `keyword`: 1.0 when the response contains every configured keyword."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from miles.core import ComponentSpec, Kind, hookimpl
from miles.core.contracts.types import Sample


@dataclass
class KeywordConfig:
    keywords: list[str] = field(default_factory=lambda: ["because"])
    case_sensitive: bool = False


class KeywordReward:
    def __init__(self, config: KeywordConfig) -> None:
        self.config = config

    async def __call__(self, response: str, sample: Sample) -> float:
        text = response if self.config.case_sensitive else response.lower()
        words = self.config.keywords
        if not self.config.case_sensitive:
            words = [w.lower() for w in words]
        return 1.0 if all(w in text for w in words) else 0.0


@hookimpl
def miles_register_rewards() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            kind=Kind.REWARD,
            name="keyword",
            factory=KeywordReward,
            summary="1.0 when the response contains every keyword",
            config=KeywordConfig,
        )
    ]
