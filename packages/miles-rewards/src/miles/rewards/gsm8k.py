"""`gsm8k`: 1.0 when the response's final number equals the reference's.

The reference may be GSM8K's whole solution ("... #### 72") or the bare number. `strict` reads the
response's last "#### <number>" (the format GSM8K's solutions teach); `flexible` its last number
anywhere. Numbers compare exactly as decimals after removing thousands separators and `$`, so
"1,000", "$1000" and "1000.00" all equal 1000.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from miles.core.contracts.types import Sample
from miles.rewards.configs import GSM8KConfig

_STRICT = re.compile(r"####\s*\$?\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?")


def extract_answer(text: str, mode: str) -> str | None:
    """The final number of `text` as a string ("1,000" -> "1000"), or None if there is none."""
    found: list[str] = (_STRICT if mode == "strict" else _NUMBER).findall(text)
    if not found:
        return None
    return found[-1].replace(",", "").replace("$", "")


def same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return a.strip() == b.strip()


class GSM8K:
    reward_range: tuple[float, float] = (0.0, 1.0)
    deterministic: bool = True

    def __init__(self, config: GSM8KConfig) -> None:
        self.config = config

    async def __call__(self, response: str, sample: Sample) -> float:
        key = self.config.answer_key
        if key not in sample.metadata:
            raise KeyError(
                f"gsm8k: the data row has no {key!r} field (fields: {sorted(sample.metadata)}); "
                "set reward.answer_key"
            )
        reference = str(sample.metadata[key])
        # A full GSM8K solution states its answer after "####"; a bare number is the answer.
        expected = extract_answer(reference, "strict" if "####" in reference else "flexible")
        if expected is None:
            raise ValueError(f"gsm8k: no number in the reference answer {reference!r}")
        got = extract_answer(response, self.config.mode)
        return 1.0 if got is not None and same_number(got, expected) else 0.0
