"""Scoring finished samples with the run's reward: per sample, or per group where the reward
batches (`score_group`), with a time-out, and with failures recorded instead of raised.

A reward that raises, times out or returns a non-finite number marks its sample `failed` with the
error (counted in `rollout/reward_errors`); the run goes on unless `reward.on_error: fail`.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, cast

import structlog

from miles.core.contracts.protocols import GroupReward, Tokenizer
from miles.core.contracts.types import Sample, SampleStatus

log = structlog.get_logger(__name__)


class RewardError(RuntimeError):
    """A reward failed and the config asks the run to stop (`reward.on_error: fail`)."""


class RewardScorer:
    """Scores groups with `reward`: one `score_group` call per group when `groups` (the reward
    declares `Capability.SCORES_GROUPS`), else one call per sample."""

    def __init__(
        self,
        reward: Any,
        name: str,
        tokenizer: Tokenizer,
        *,
        groups: bool = False,
        on_error: str = "mark_failed",
        timeout_s: float | None = None,
    ) -> None:
        self.reward, self.name, self.tokenizer = reward, name, tokenizer
        self.groups, self.on_error, self.timeout_s = groups, on_error, timeout_s

    async def score(self, group: list[Sample]) -> None:
        """Sets `reward` on each sample of one group (or marks it failed)."""
        live = [s for s in group if s.status is not SampleStatus.FAILED]
        if not live:
            return
        texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in live]
        if self.groups:
            try:
                reward = cast(GroupReward, self.reward)
                scores = list(await self._timed(reward.score_group(texts, live)))
                if len(scores) != len(live):
                    raise ValueError(f"score_group returned {len(scores)} scores for {len(live)}")
            except Exception as exc:
                for sample in live:
                    self._failed(sample, exc)
                return
            for sample, score in zip(live, scores, strict=True):
                self._set(sample, score)
            return

        async def one(sample: Sample, text: str) -> None:
            try:
                self._set(sample, await self._timed(self.reward(text, sample)))
            except Exception as exc:
                self._failed(sample, exc)

        await asyncio.gather(*(one(s, t) for s, t in zip(live, texts, strict=True)))

    async def _timed(self, awaitable: Any) -> Any:
        if self.timeout_s is None:
            return await awaitable
        try:
            return await asyncio.wait_for(awaitable, self.timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no score within reward.timeout_s={self.timeout_s}") from None

    def _set(self, sample: Sample, score: Any) -> None:
        try:
            value = float(score)
        except (TypeError, ValueError):
            self._failed(sample, TypeError(f"returned {score!r}, not a number"))
            return
        if not math.isfinite(value):
            self._failed(sample, ValueError(f"returned {value}"))
            return
        sample.reward = value

    def _failed(self, sample: Sample, exc: BaseException) -> None:
        message = f"reward {self.name!r}: {type(exc).__name__}: {exc}"
        if self.on_error == "fail":
            raise RewardError(
                f"{message} (sample {sample.sample_id}); set reward.on_error: mark_failed to "
                "record such samples as failed and go on"
            ) from exc
        sample.status, sample.error = SampleStatus.FAILED, message
        sample.metadata["reward_error"] = True
        log.warning("reward failed", sample_id=sample.sample_id, error=message)
