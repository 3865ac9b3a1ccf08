"""Config sections of the task rewards (`math`, `gsm8k`, `countdown`, `format`, `overlong`,
`remote_rm`, `llm_judge`). Plain dataclasses with no heavy imports: the CLI validates a run config
against them without importing math-verify or an HTTP client.

The keys `name`, `on_error` and `timeout_s` of the `reward:` section belong to the run (see
`RewardSection`), so no config here uses them: per-request HTTP time-outs are `request_timeout_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class MathConfig:
    answer_key: str = "answer"  # the data-row field holding the reference answer
    # true: only the last \boxed{...} of the response counts; false: math-verify's own extraction
    # (\boxed{} first, then "final answer is ...", then the last LaTeX or plain expression).
    boxed_only: bool = False
    # math-verify's per-parse and per-comparison time-out (seconds, signal-based, so enforced only
    # where it runs on a process's main thread: always so with `workers > 0`).
    verify_timeout_s: int = 5
    # Verification is CPU-bound sympy work that can take seconds: >0 runs it in that many worker
    # processes so the rollout event loop never blocks; 0 runs it inline (tests, debugging).
    workers: int = 2

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0, got {self.workers}")
        if self.verify_timeout_s <= 0:
            raise ValueError(f"verify_timeout_s must be > 0, got {self.verify_timeout_s}")


@dataclass
class GSM8KConfig:
    answer_key: str = "answer"  # GSM8K's full solution ("... #### 72") or just the number
    # strict: the response must state "#### <number>"; flexible: the last number in the response.
    mode: Literal["strict", "flexible"] = "strict"


@dataclass
class CountdownConfig:
    target_key: str = "target"
    numbers_key: str = "numbers"
    answer_tag: str = "answer"  # the equation is read from the last <answer>...</answer>
    # true: no answer tags, no score; false: fall back to the response's last non-empty line.
    require_tag: bool = False
    # Reward for a well-formed equation that is wrong (TinyZero uses 0.1); 0 gives a pure 0/1.
    format_score: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.format_score <= 1.0:
            raise ValueError(f"format_score must be in [0, 1], got {self.format_score}")


@dataclass
class FormatConfig:
    # Tag names whose blocks <tag>...</tag> must appear, in this order.
    tags: list[str] = field(default_factory=lambda: ["think", "answer"])
    # true: the response is exactly these blocks, each once, with only whitespace between and
    # around them; false: the blocks appear in this order, any other text allowed.
    strict: bool = True

    def __post_init__(self) -> None:
        if not self.tags:
            raise ValueError("tags must name at least one tag")
        bad = [t for t in self.tags if not t or not t.replace("_", "").replace("-", "").isalnum()]
        if bad:
            raise ValueError(f"tags must be letters, digits, '_' or '-': {bad}")


@dataclass
class OverlongConfig:
    max_len: int = 4096  # L_max: response tokens past this get -1
    buffer: int = 512  # L_cache: the penalty ramps from 0 to -1 over the last `buffer` tokens

    def __post_init__(self) -> None:
        if not 0 < self.buffer <= self.max_len:
            raise ValueError(
                f"need 0 < buffer <= max_len, got buffer={self.buffer}, max_len={self.max_len}"
            )


@dataclass
class RemoteRMConfig:
    url: str  # the reward server's endpoint, e.g. http://rm-host:5000/get_reward
    prompt_key: str = "prompt"  # the data-row field with the prompt text
    label_key: str | None = "answer"  # sent as `labels`; a row without it sends null
    # How `query` is built from the row's raw prompt and the decoded response.
    query_template: str = "{prompt}{response}"
    score_key: str = "rewards"  # the response field holding one score per query
    batch_size: int | None = None  # queries per request; null: the whole group in one request
    api_key_env: str | None = None  # env var holding a bearer token (the key never in config)
    request_timeout_s: float = 60.0
    max_retries: int = 3  # retries after the first attempt
    backoff_s: float = 0.5  # first retry waits ~this, doubling each time (with jitter) ...
    backoff_max_s: float = 10.0  # ... up to this

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or null, got {self.batch_size}")
        _check_http(self.request_timeout_s, self.max_retries, self.backoff_s, self.backoff_max_s)


DEFAULT_JUDGE_TEMPLATE = """\
You are grading a response to a question.

Question:
{prompt}

Reference answer:
{answer}

Response:
{response}

Rate how correct and helpful the response is on a scale from 0 to 10. End your reply with a \
line of the form "Score: N"."""


@dataclass
class LLMJudgeConfig:
    base_url: str  # an OpenAI-compatible API root, e.g. http://judge:8000/v1
    model: str
    # Placeholders: {prompt}, {response}, {answer}. Write literal braces as {{ and }}.
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    system_prompt: str | None = None
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"  # null: no reference; {answer} is then empty
    api_key_env: str | None = None  # e.g. OPENAI_API_KEY; null: no Authorization header
    temperature: float = 0.0
    max_tokens: int = 1024
    # The first capture group is the score; if it does not match, the last number in the reply.
    score_pattern: str = r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)"
    score_min: float = 0.0  # the judge's scale, mapped linearly onto [0, 1] and clipped
    score_max: float = 10.0
    # Reward when the reply holds no number; null: the sample fails with the reply in the error.
    unparsed_score: float | None = None
    max_concurrency: int = 16  # judge requests in flight per group
    request_timeout_s: float = 120.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {self.base_url!r}")
        if not self.score_max > self.score_min:
            raise ValueError(f"need score_max > score_min, got {self.score_min}..{self.score_max}")
        if self.unparsed_score is not None and not 0.0 <= self.unparsed_score <= 1.0:
            raise ValueError(f"unparsed_score must be in [0, 1], got {self.unparsed_score}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        _check_http(self.request_timeout_s, self.max_retries, self.backoff_s, self.backoff_max_s)


def _check_http(timeout_s: float, retries: int, backoff_s: float, backoff_max_s: float) -> None:
    if timeout_s <= 0:
        raise ValueError(f"request_timeout_s must be > 0, got {timeout_s}")
    if retries < 0:
        raise ValueError(f"max_retries must be >= 0, got {retries}")
    if backoff_s < 0 or backoff_max_s < backoff_s:
        raise ValueError(f"need 0 <= backoff_s <= backoff_max_s, got {backoff_s}, {backoff_max_s}")
