"""`single_turn`: one prompt, `n` independent responses, one engine call per group."""

from __future__ import annotations

from dataclasses import dataclass

from miles.core.contracts.protocols import PromptGroup, RolloutContext
from miles.core.contracts.types import GenerateRequest, Sample, SampleStatus

_STATUS = {
    "stop": SampleStatus.COMPLETED,
    "length": SampleStatus.TRUNCATED,
    "abort": SampleStatus.ABORTED,
}


@dataclass
class SingleTurnConfig:
    pass


class SingleTurn:
    def __init__(self, config: SingleTurnConfig) -> None:
        self.config = config

    async def __call__(self, ctx: RolloutContext, group: PromptGroup) -> list[Sample]:
        requests = [
            GenerateRequest(sid, group.prompt_ids, ctx.sampling) for sid in group.sample_ids
        ]
        results = await ctx.generate(requests)
        return [
            Sample(
                prompt_ids=group.prompt_ids,
                response_ids=r.response_ids,
                rollout_logprobs=r.logprobs,
                group_id=group.group_id,
                sample_id=r.request_id,
                weight_version=r.weight_version,
                status=_STATUS.get(r.finish_reason, SampleStatus.FAILED),
                error=None if r.finish_reason in _STATUS else f"finish_reason {r.finish_reason!r}",
                routing=r.routing,
                routing_weights=r.routing_weights,
                metadata=dict(group.row),
            )
            for r in results
        ]
