"""The inputs the checks score: ordinary responses, and the garbage a young policy produces."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any

from miles.core.contracts.types import Sample


@dataclass(frozen=True)
class Case:
    """One input to score: a response and the sample (data row) it answers."""

    label: str
    response: str
    sample: Sample = field(compare=False)


def default_sample() -> Sample:
    """A plausible finished sample: a math prompt whose data row carries the usual answer keys."""
    return Sample(
        prompt_ids=[101, 102, 103, 104],
        response_ids=[201, 202, 203],
        rollout_logprobs=[-0.5, -1.0, -0.25],
        metadata={
            "prompt": "What is 6 * 7? Answer with a number.",
            "answer": "42",
            "label": "42",
            "ground_truth": "42",
            "solution": "6 * 7 = 42",
        },
    )


def with_row(sample: Sample, row: dict[str, Any]) -> Sample:
    """`sample` with the data-row fields of `row` added to (or replacing) its metadata."""
    return dataclasses.replace(sample, metadata={**sample.metadata, **row})


def sample_cases() -> list[Case]:
    """Ordinary responses: right, wrong, verbose and off-topic."""
    responses = {
        "a correct answer": "42",
        "a correct sentence": "The answer is 42.",
        "a reasoning trace": "Let's think step by step. 6 * 7 = 42. So the answer is \\boxed{42}.",
        "a wrong answer": "The answer is 41.",
        "an off-topic response": "I like trains.",
    }
    return [Case(label, text, default_sample()) for label, text in responses.items()]


def garbage_cases(sample: Sample | None = None, seed: int = 0) -> list[Case]:
    """Responses a half-trained policy produces: noise, control bytes, and very long text."""
    rng = random.Random(seed)
    # Any code point but the surrogates, which no tokenizer's decode returns.
    unicode_noise = "".join(
        chr(rng.choice([rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x110000)]))
        for _ in range(20_000)
    )
    binary_ish = "".join(chr(rng.randrange(0, 256)) for _ in range(5_000))
    responses = {
        "whitespace only": " \n\t \r\n ",
        "long random unicode": unicode_noise,
        "binary-ish text": binary_ish,
        "a huge response (2 MB)": "the answer is 42 " * 120_000,
        "unbalanced markup": "\\boxed{ {{{ <think> ``` $$ \\frac{",
    }
    row = sample if sample is not None else default_sample()
    return [Case(label, text, row) for label, text in responses.items()]
