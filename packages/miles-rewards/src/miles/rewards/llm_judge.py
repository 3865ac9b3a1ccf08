"""`llm_judge`: an LLM grades each response through any OpenAI-compatible chat endpoint
(vLLM, SGLang, OpenAI, ...):

    POST {base_url}/chat/completions  {"model", "messages", "temperature", "max_tokens"}
    200  {"choices": [{"message": {"content": "... Score: 7"}}], ...}

The judge's prompt is `prompt_template` filled with the row's prompt, the response and the row's
reference answer. Its reply is read with `score_pattern` (default: "Score: N"), falling back to the
last number, then mapped from [score_min, score_max] onto [0, 1]. A group's requests run
concurrently, at most `max_concurrency` at a time; each is retried like `remote_rm`'s.
"""

from __future__ import annotations

import asyncio
import re
from typing import TYPE_CHECKING, Any, ClassVar

from miles.core.contracts.types import Sample
from miles.rewards.configs import LLMJudgeConfig
from miles.rewards.remote_rm import (
    RemoteRewardError,
    RetryPolicy,
    bearer_headers,
    check_template,
    new_client,
    post_json,
    row_field,
)

if TYPE_CHECKING:
    import httpx2 as httpx

_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_score(text: str, pattern: re.Pattern[str], low: float, high: float) -> float | None:
    """The judge's score mapped onto [0, 1] (clipped), or None when the reply has no number."""
    found = pattern.findall(text)
    if not found:
        found = _LAST_NUMBER.findall(text)
    if not found:
        return None
    raw = float(found[-1])
    return min(1.0, max(0.0, (raw - low) / (high - low)))


class LLMJudge:
    reward_range: tuple[float, float] = (0.0, 1.0)
    conformance_skip: ClassVar[str] = (
        "calls an OpenAI-compatible server: check it against yours with "
        "miles.plugin_kit.conformance.check_reward('llm_judge', config=LLMJudgeConfig(...))"
    )
    # Temperature 0 is not bit-reproducible on batched GPU servers, and the judge may change.
    deterministic: bool = False

    def __init__(self, config: LLMJudgeConfig) -> None:
        self.config = config
        check_template(
            config.prompt_template, {"prompt", "response", "answer"}, "llm_judge", "prompt_template"
        )
        self._pattern = re.compile(config.score_pattern, re.IGNORECASE)
        if self._pattern.groups != 1:
            raise ValueError("llm_judge: reward.score_pattern needs exactly one capture group")
        self._url = config.base_url.rstrip("/") + "/chat/completions"
        self._headers = bearer_headers(config.api_key_env, "llm_judge")
        self._policy = RetryPolicy(
            config.request_timeout_s, config.max_retries, config.backoff_s, config.backoff_max_s
        )

    async def __call__(self, response: str, sample: Sample) -> float:
        return (await self.score_group([response], [sample]))[0]

    async def score_group(self, responses: list[str], samples: list[Sample]) -> list[float]:
        limit = asyncio.Semaphore(self.config.max_concurrency)
        async with new_client(self._headers) as client:

            async def one(response: str, sample: Sample) -> float:
                async with limit:
                    return await self._judge(client, response, sample)

            return list(
                await asyncio.gather(*(one(r, s) for r, s in zip(responses, samples, strict=True)))
            )

    def messages(self, response: str, sample: Sample) -> list[dict[str, str]]:
        cfg = self.config
        answer = sample.metadata.get(cfg.answer_key, "") if cfg.answer_key else ""
        user = cfg.prompt_template.format(
            prompt=row_field(sample, cfg.prompt_key, "llm_judge", "prompt_key"),
            response=response,
            answer=answer,
        )
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    async def _judge(self, client: httpx.AsyncClient, response: str, sample: Sample) -> float:
        cfg = self.config
        payload = {
            "model": cfg.model,
            "messages": self.messages(response, sample),
            "temperature": cfg.temperature,
            "max_tokens": cfg.max_tokens,
        }
        reply = await post_json(client, self._url, payload, self._policy, "llm_judge")
        text = _content(reply)
        score = parse_score(text, self._pattern, cfg.score_min, cfg.score_max)
        if score is not None:
            return score
        if cfg.unparsed_score is not None:
            return cfg.unparsed_score
        raise ValueError(
            f"llm_judge: no score in the judge's reply {text[-300:]!r}; adjust "
            "reward.score_pattern / prompt_template, or set reward.unparsed_score"
        )


def _content(reply: Any) -> str:
    try:
        content = reply["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise RemoteRewardError(
            f"llm_judge: not a chat-completions reply: {str(reply)[:200]}"
        ) from None
    if not isinstance(content, str):
        # Reasoning servers may put everything in `reasoning_content` and leave this null when
        # max_tokens runs out mid-thought.
        raise RemoteRewardError(f"llm_judge: the reply has no text content ({content!r})")
    return content
