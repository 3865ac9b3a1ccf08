"""`multi_turn`: the model acts, an environment answers, for several turns per sample.

Tokens in, tokens out. The sample's response is one growing token list: each model turn is
appended exactly as generated (loss mask 1, with its logprobs), and each observation is tokenized
on its own and appended (loss mask 0, logprob 0). Earlier turns are never re-tokenized, so what the
trainer sees is exactly what the engine produced and read.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from miles.core.config import ComponentRef
from miles.core.config.tools import ConfigError, build
from miles.core.contracts.components import Kind
from miles.core.contracts.protocols import Environment, PromptGroup, RolloutContext
from miles.core.contracts.types import GenerateRequest, Sample, SampleStatus, token_versions
from miles.core.registry.factory import build_component
from miles.core.registry.plugins import get_plugin_manager


@dataclass
class MultiTurnConfig:
    env: ComponentRef | str = "calculator"  # an environment component and its options
    max_turns: int = 4
    # Tokens one model turn may generate; rollout.max_new_tokens bounds the whole response
    # (model turns and observations together).
    max_turn_tokens: int | None = None
    # How an observation is shown to the model; it is tokenized alone and never trained on.
    observation_template: str = "\n<result>{observation}</result>\n"
    # Stop strings that end a model turn (a tool call); the rollout's own stop settings still apply.
    turn_stop: list[str] = field(default_factory=lambda: ["</calc>", "</answer>"])

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError("max_turns must be at least 1")
        if isinstance(self.env, str):
            self.env = ComponentRef(self.env)
        # Check the environment and its options with the rest of the config, before any worker.
        try:
            spec = get_plugin_manager().get(Kind.ENVIRONMENT, self.env.name).spec
            if spec.config is not None:
                build(spec.config, self.env.options, "env")
        except (LookupError, ConfigError) as exc:
            raise ValueError(f"env: {exc}") from None


class MultiTurn:
    def __init__(self, config: MultiTurnConfig) -> None:
        self.config = config

    def _env(self) -> Environment:
        env = self.config.env
        assert isinstance(env, ComponentRef)
        return build_component(Kind.ENVIRONMENT, env, path="rollout.function.env")  # type: ignore[no-any-return]

    async def __call__(self, ctx: RolloutContext, group: PromptGroup) -> list[Sample]:
        return list(
            await asyncio.gather(*(self._episode(ctx, group, sid) for sid in group.sample_ids))
        )

    async def _episode(self, ctx: RolloutContext, group: PromptGroup, sample_id: int) -> Sample:
        env = self._env()
        budget = ctx.sampling.max_new_tokens  # model and observation tokens together
        sampling = replace(
            ctx.sampling, stop_strings=(*ctx.sampling.stop_strings, *self.config.turn_stop)
        )
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        routing: Any = None
        start = await env.reset(group.row)
        total, status, turns = start.reward, SampleStatus.COMPLETED, 0
        self._observe(ctx, start.observation, response, mask, logprobs, versions)
        done = start.done
        while not done and turns < self.config.max_turns:
            left = budget - len(response)
            if left <= 0:
                status = SampleStatus.TRUNCATED
                break
            if self.config.max_turn_tokens is not None:
                left = min(left, self.config.max_turn_tokens)
            request = GenerateRequest(
                sample_id, group.prompt_ids + response, replace(sampling, max_new_tokens=left)
            )
            (result,) = await ctx.generate([request])
            routing = result.routing  # covers this turn's prompt (all before it) and response
            turns += 1
            response += result.response_ids
            mask += [1] * len(result.response_ids)
            logprobs += result.logprobs
            versions += token_versions(result.weight_version, len(result.response_ids))
            if result.finish_reason == "abort":
                status = SampleStatus.ABORTED
                break
            action = ctx.tokenizer.decode(result.response_ids, skip_special_tokens=True)
            step = await env.step(action)
            total += step.reward
            done = step.done
            if not done:
                self._observe(ctx, step.observation, response, mask, logprobs, versions)
            elif result.finish_reason == "length":
                status = SampleStatus.TRUNCATED
        if not done and status is SampleStatus.COMPLETED:
            status = SampleStatus.TRUNCATED  # out of turns
        return Sample(
            routing=_fit(routing, len(group.prompt_ids) + len(response)),
            prompt_ids=group.prompt_ids,
            response_ids=response,
            rollout_logprobs=logprobs,
            loss_mask=mask,
            group_id=group.group_id,
            sample_id=sample_id,
            weight_version=versions if len(set(versions)) > 1 else (versions or [0])[0],
            status=status,
            metadata={**group.row, "env_reward": total, "turns": turns},
        )

    def _observe(
        self,
        ctx: RolloutContext,
        observation: str,
        response: list[int],
        mask: list[int],
        logprobs: list[float],
        versions: list[int],
    ) -> None:
        if not observation:
            return
        text = self.config.observation_template.format(observation=observation)
        ids: Any = ctx.tokenizer.encode(text, add_special_tokens=False)
        response += ids
        mask += [0] * len(ids)
        logprobs += [0.0] * len(ids)
        versions += [versions[-1] if versions else 0] * len(ids)


def _fit(routing: Any, n: int) -> Any:
    """A routing record of exactly n rows: tokens after the last turn (an observation) have none."""
    if routing is None or len(routing) == n:
        return routing
    out = np.full((n, *routing.shape[1:]), -1, dtype=routing.dtype)
    out[: min(n, len(routing))] = routing[:n]
    return out
