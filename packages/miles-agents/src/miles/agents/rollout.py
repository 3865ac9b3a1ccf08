"""Rollout function `agent` (see `miles.agents.api`): each sample is one episode of the
configured agent against its own base URL on the gateway, and the sample is the gateway's record
of the episode's calls."""

from __future__ import annotations

import asyncio
import inspect
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.agents.api import Agent, AgentOutcome, AgentRolloutConfig, AgentSession
from miles.agents.gateway import AgentGateway
from miles.agents.trajectory import Trajectory
from miles.core.config import ComponentRef
from miles.core.contracts.components import Kind
from miles.core.contracts.protocols import PromptGroup, RolloutContext
from miles.core.contracts.types import Sample, SampleStatus
from miles.core.registry.factory import build_component


class AgentRollout:
    def __init__(self, config: AgentRolloutConfig) -> None:
        self.config = config
        assert isinstance(config.agent, ComponentRef)
        self.agent: Agent = build_component(Kind.AGENT, config.agent, path="rollout.function.agent")
        self._gateway: AgentGateway | None = None
        self._threads = ThreadPoolExecutor(config.max_concurrent, thread_name_prefix="agent")

    def _gateway_for(self, ctx: RolloutContext) -> AgentGateway:
        if self._gateway is None:
            self._gateway = AgentGateway(ctx.tokenizer, "miles-policy", self.config.host)
            self._gateway.start()
        return self._gateway

    async def __call__(self, ctx: RolloutContext, group: PromptGroup) -> list[Sample]:
        gateway = self._gateway_for(ctx)
        return list(
            await asyncio.gather(*(self._episode(ctx, gateway, group, s) for s in group.sample_ids))
        )

    async def _episode(
        self, ctx: RolloutContext, gateway: AgentGateway, group: PromptGroup, sample_id: int
    ) -> Sample:
        url, trajectory, out_of_budget = gateway.open(ctx, sample_id, ctx.sampling.max_new_tokens)
        session = AgentSession(url, gateway.model, dict(group.row), group.group_id, sample_id)
        error: str | None = None
        outcome = AgentOutcome()
        try:
            got = await asyncio.wait_for(self._run(session), self.config.episode_timeout_s)
            outcome = got if isinstance(got, AgentOutcome) else AgentOutcome(_reward(got))
        except TimeoutError:
            error = f"the agent took longer than episode_timeout_s={self.config.episode_timeout_s}"
        except Exception as exc:  # the agent's own failure: this sample fails, the run goes on
            error = f"the agent raised {type(exc).__name__}: {exc}"
        finally:
            gateway.close(url)
        error = trajectory.diverged or error  # the root cause, when the agent only saw a 400
        if error is None and trajectory.calls == 0:
            error = "the agent made no model call"
        sample = _sample(group, sample_id, trajectory, outcome, error, out_of_budget())
        if trajectory.refused is not None:  # counted as agent/refused/<reason>
            sample.metadata["agent_refused"] = trajectory.refused
        elif error is None and (drift := trajectory.retemplate_drift()) is not None:
            sample.metadata["agent_retemplate_drift"] = drift  # agent/retemplate_drift_frac
        return sample

    async def _run(self, session: AgentSession) -> Any:
        call = type(self.agent).__call__ if not inspect.isroutine(self.agent) else self.agent
        if inspect.iscoroutinefunction(call):  # an async def function or __call__
            return await self.agent(session)  # type: ignore[misc]
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self.agent, session)


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"an agent returns a float reward, an AgentOutcome or None, got {type(value).__name__}"
        )
    return float(value)


def _sample(
    group: PromptGroup,
    sample_id: int,
    t: Trajectory,
    outcome: AgentOutcome,
    error: str | None,
    out_of_budget: bool,
) -> Sample:
    status = SampleStatus.COMPLETED
    if error is not None:
        status = SampleStatus.FAILED
    elif "abort" in t.finish_reasons:
        status = SampleStatus.ABORTED
    elif out_of_budget:
        status = SampleStatus.TRUNCATED
    metadata = {**group.row, **outcome.metadata, "turns": t.calls}
    if outcome.reward is not None:
        metadata["env_reward"] = outcome.reward
    versions = t.versions
    return Sample(
        prompt_ids=t.prompt_ids or list(group.prompt_ids),
        response_ids=t.response_ids,
        rollout_logprobs=t.logprobs,
        loss_mask=t.loss_mask,
        group_id=group.group_id,
        sample_id=sample_id,
        weight_version=versions if len(set(versions)) > 1 else (versions or [0])[0],
        status=status,
        error=error,
        routing=t.fitted_routing(),
        metadata=metadata,
    )
