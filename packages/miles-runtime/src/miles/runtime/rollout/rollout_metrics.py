"""The `rollout/*` metrics of one step batch."""

from __future__ import annotations

from collections import Counter

import numpy as np

from miles.core.contracts.types import Sample, SampleStatus
from miles.runtime.rollout.buffer import StepBatch


def rollout_metrics(
    batch: StepBatch, kept: list[Sample], samples_per_prompt: int
) -> dict[str, float]:
    flat = batch.generated
    rewards = [s.reward for s in flat if s.reward is not None]
    lengths = [len(s.response_ids) for s in flat]
    tokens = sum(lengths)
    seconds = batch.seconds
    generated_groups = len(flat) // max(samples_per_prompt, 1)
    # Model calls per episode, where the rollout function records them (multi_turn, agent).
    turns = [s.metadata["turns"] for s in flat if isinstance(s.metadata.get("turns"), int)]
    extra = {"rollout/turns_mean": float(np.mean(turns))} if turns else {}
    return {
        **extra,
        **agent_metrics(flat),
        "rollout/reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "rollout/reward_std": float(np.std(rewards)) if rewards else 0.0,
        "rollout/response_len_mean": float(np.mean(lengths)) if lengths else 0.0,
        "rollout/truncated_frac": float(np.mean([s.status is SampleStatus.TRUNCATED for s in flat]))
        if flat
        else 0.0,
        "rollout/reward_errors": float(sum(1 for s in flat if s.metadata.get("reward_error"))),
        "rollout/failed": float(sum(1 for s in flat if s.status is SampleStatus.FAILED)),
        "rollout/samples": float(len(flat)),
        "rollout/kept_samples": float(len(kept)),
        "rollout/filtered_frac": 1.0 - len(kept) / len(flat) if flat else 0.0,
        "rollout/tokens": float(tokens + sum(len(s.prompt_ids) for s in kept)),
        "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "rollout/dropped_group_frac": 1 - len(batch.kept) / max(generated_groups, 1),
        "rollout/oversample_rounds": float(batch.extra_rounds),
        "perf/rollout_s": seconds,  # generating it; the trainer may wait less
    }


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Episodes of rollout function `agent`: `agent/refused/<reason>`, episodes failed by a call
    the gateway refused, by reason, and `agent/refused` in all; `agent/retemplate_drift_frac`, of
    the accepted episodes that ended with a chat call, the share whose conversation the chat
    template renders afresh into other tokens than the ones trained on."""
    refused = Counter(
        str(s.metadata["agent_refused"]) for s in samples if s.metadata.get("agent_refused")
    )
    drift = [
        bool(s.metadata["agent_retemplate_drift"])
        for s in samples
        if "agent_retemplate_drift" in s.metadata
    ]
    if not refused and not drift:
        return {}
    out = {f"agent/refused/{reason}": float(n) for reason, n in sorted(refused.items())}
    out["agent/refused"] = float(sum(refused.values()))
    if drift:
        out["agent/retemplate_drift_frac"] = float(np.mean(drift))
    return out
