"""`exact_match`: 1.0 when the response equals the reference answer of the sample's data row."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.contracts.types import Sample


@dataclass
class ExactMatchConfig:
    answer_key: str = "answer"  # the data-row field holding the reference answer
    strip: bool = True  # compare with surrounding whitespace removed
    case_sensitive: bool = True


class ExactMatch:
    def __init__(self, config: ExactMatchConfig) -> None:
        self.config = config

    async def __call__(self, response: str, sample: Sample) -> float:
        if self.config.answer_key not in sample.metadata:
            raise KeyError(
                f"exact_match: the data row has no {self.config.answer_key!r} field "
                f"(fields: {sorted(sample.metadata)}); set reward.answer_key"
            )
        expected = str(sample.metadata[self.config.answer_key])
        got = response
        if self.config.strip:
            expected, got = expected.strip(), got.strip()
        if not self.config.case_sensitive:
            expected, got = expected.lower(), got.lower()
        return 1.0 if got == expected else 0.0
