"""`remote_rm`: scores from a reward model served over HTTP, in OpenRLHF's remote-RM protocol.

    POST {url}   {"query": [prompt + response, ...], "prompts": [prompt, ...], "labels": [...]}
    200          {"rewards": [float, ...], ...}        (one per query, in order)

which is what OpenRLHF's `remote_rm_fn` sends and its `serve_rm` answers (extra response fields such
as `scores` or `extra_logs` are ignored). `query` is the row's raw prompt (`prompt_key`) joined
with the decoded response by `query_template`: the chat-templated prompt text is not available to
rewards, so a server that needs it renders the template itself from `prompts`.

A group is sent as one request (or `batch_size`-query chunks, concurrently). Connection errors,
time-outs, 408/429 and 5xx are retried with capped exponential backoff and jitter; other 4xx and
malformed replies fail at once, since retrying cannot fix them.
"""

from __future__ import annotations

import asyncio
import os
import random
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from miles.core.contracts.types import Sample
from miles.rewards.configs import RemoteRMConfig

if TYPE_CHECKING:
    import httpx2 as httpx

_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class RemoteRewardError(RuntimeError):
    """A reward server could not be reached, or answered something unusable."""


@dataclass(frozen=True)
class RetryPolicy:
    timeout_s: float
    max_retries: int
    backoff_s: float
    backoff_max_s: float

    def delay(self, retry: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based): the server's Retry-After when it
        gives one, else backoff_s * 2**retry; capped, with jitter so clients don't retry in step."""
        if retry_after is not None:
            try:
                return max(0.0, min(float(retry_after), self.backoff_max_s))
            except ValueError:
                pass  # an HTTP date: fall back to our own schedule
        return min(self.backoff_s * 2.0**retry, self.backoff_max_s) * random.uniform(0.5, 1.0)


def bearer_headers(api_key_env: str | None, who: str) -> dict[str, str]:
    """The Authorization header from the named environment variable (never from the config)."""
    if api_key_env is None:
        return {}
    key = os.environ.get(api_key_env)
    if not key:
        raise RemoteRewardError(f"{who}: environment variable {api_key_env} (api_key_env) is unset")
    return {"Authorization": f"Bearer {key}"}


def new_client(headers: dict[str, str]) -> httpx.AsyncClient:
    """An HTTP client; httpx is imported here so `miles --help` does not pay for it."""
    import httpx2

    return httpx2.AsyncClient(headers=headers)


async def post_json(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    policy: RetryPolicy,
    who: str,
    headers: dict[str, str] | None = None,
) -> Any:
    """POSTs `payload` and returns the decoded JSON reply, retrying what a retry can fix."""
    import httpx2 as httpx

    attempts = policy.max_retries + 1
    last = ""
    for attempt in range(attempts):
        retry_after = None
        try:
            reply = await client.post(url, json=payload, headers=headers, timeout=policy.timeout_s)
        except httpx.TimeoutException as exc:
            last = f"no reply within request_timeout_s={policy.timeout_s} ({type(exc).__name__})"
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if reply.status_code < 300:
                try:
                    return reply.json()
                except ValueError:
                    raise RemoteRewardError(
                        f"{who}: POST {url} answered non-JSON: {reply.text[:200]!r}"
                    ) from None
            last = f"HTTP {reply.status_code}: {reply.text[:200]!r}"
            if reply.status_code not in _RETRYABLE_STATUS:
                raise RemoteRewardError(f"{who}: POST {url} failed with {last} (not retried)")
            retry_after = reply.headers.get("retry-after")
        if attempt + 1 < attempts:
            await asyncio.sleep(policy.delay(attempt, retry_after))
    raise RemoteRewardError(
        f"{who}: POST {url} failed {attempts} times (last: {last}); check that the server is up "
        "and reachable, or raise reward.max_retries / reward.request_timeout_s"
    )


def check_template(template: str, allowed: set[str], who: str, setting: str) -> None:
    """Fails at construction, not mid-run, on a placeholder the reward does not fill."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"{who}: reward.{setting} is not a valid template: {exc}") from None
    unknown = names - allowed
    if unknown:
        raise ValueError(
            f"{who}: reward.{setting} uses {sorted(unknown)}; the placeholders are "
            f"{sorted(allowed)} (write literal braces as {{{{ and }}}})"
        )


def row_field(sample: Sample, key: str, who: str, setting: str) -> Any:
    if key not in sample.metadata:
        raise KeyError(
            f"{who}: the data row has no {key!r} field (fields: {sorted(sample.metadata)}); "
            f"set reward.{setting}"
        )
    return sample.metadata[key]


class RemoteRM:
    # Whatever the served model outputs: normalised or not, the protocol does not bound it.
    reward_range: tuple[float, float] = (float("-inf"), float("inf"))
    conformance_skip: ClassVar[str] = (
        "calls a reward-model server: check it against yours with "
        "miles.plugin_kit.conformance.check_reward('remote_rm', config=RemoteRMConfig(url=...))"
    )
    # Batched bf16 inference on a server we do not control: equal inputs may differ slightly.
    deterministic: bool = False

    def __init__(self, config: RemoteRMConfig) -> None:
        self.config = config
        check_template(config.query_template, {"prompt", "response"}, "remote_rm", "query_template")
        self._headers = bearer_headers(config.api_key_env, "remote_rm")
        self._policy = RetryPolicy(
            config.request_timeout_s, config.max_retries, config.backoff_s, config.backoff_max_s
        )

    async def __call__(self, response: str, sample: Sample) -> float:
        return (await self.score_group([response], [sample]))[0]

    async def score_group(self, responses: list[str], samples: list[Sample]) -> list[float]:
        cfg = self.config
        prompts = [str(row_field(s, cfg.prompt_key, "remote_rm", "prompt_key")) for s in samples]
        labels = [s.metadata.get(cfg.label_key) if cfg.label_key else None for s in samples]
        queries = [
            cfg.query_template.format(prompt=p, response=r)
            for p, r in zip(prompts, responses, strict=True)
        ]
        size = cfg.batch_size or len(queries)
        chunks = [slice(i, i + size) for i in range(0, len(queries), size)]
        # A client per call: the scorer may call from different event loops over a run.
        async with new_client(self._headers) as client:
            replies = await asyncio.gather(
                *(
                    post_json(
                        client,
                        cfg.url,
                        {"query": queries[c], "prompts": prompts[c], "labels": labels[c]},
                        self._policy,
                        "remote_rm",
                    )
                    for c in chunks
                )
            )
        scores: list[float] = []
        for chunk, reply in zip(chunks, replies, strict=True):
            scores.extend(self._scores(reply, len(queries[chunk])))
        return scores

    def _scores(self, reply: Any, expected: int) -> list[float]:
        key = self.config.score_key
        if not isinstance(reply, dict) or not isinstance(reply.get(key), list):
            raise RemoteRewardError(
                f"remote_rm: {self.config.url} answered without a {key!r} list "
                f"(got {str(reply)[:200]}); set reward.score_key"
            )
        values = reply[key]
        if len(values) != expected:
            raise RemoteRewardError(
                f"remote_rm: {self.config.url} returned {len(values)} scores for {expected} queries"
            )
        try:
            return [float(v) for v in values]
        except (TypeError, ValueError):
            raise RemoteRewardError(f"remote_rm: non-numeric scores {values[:8]}") from None
