"""The critic's passes over a batch: `FSDPTrainer.values` and `FSDPTrainer.train_value_step`.

The critic (see `values` for the model) is sharded like the policy and shares its micro-batches;
it has its own optimizer and step count, because a critic step may be skipped apart from the
policy's. Like the policy's, both passes are collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist

from miles.core.contracts.protocols import PolicyLoss
from miles.core.contracts.types import PackedBatch
from miles.torch.train.microbatch import MicroBatch, batch_loss_weights, loss_inputs, per_token
from miles.torch.train.step import MetricSums, optimizer_step
from miles.torch.train.values import token_values

CRITIC_DIR = "critic"  # the critic's checkpoint, a subdirectory of the trainer's
_CRITIC_METRICS = ("critic/loss", "critic/grad_norm", "critic/lr")


@torch.no_grad()
def critic_values(
    critic: Any,
    micro_batches: list[MicroBatch],
    num_tokens: int,
    device: torch.device,
    world_size: int,
) -> npt.NDArray[np.float32]:
    """The critic's values of the whole batch (`num_tokens` long), from this rank's share of
    its micro-batches. `critic` is the sharded model (an FSDPModule)."""
    out = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    for mb in micro_batches:
        v = token_values(critic, mb)
        if not mb.is_padding:
            out[torch.from_numpy(mb.token_index).to(device)] = v
    critic.reshard()  # the root keeps its weights gathered after forward otherwise
    if world_size > 1:
        dist.all_reduce(out)  # each token was filled in by exactly one rank, 0 elsewhere
    values: npt.NDArray[np.float32] = out.cpu().numpy()
    return values


def value_step(
    critic: Any,
    optimizer: torch.optim.Optimizer,
    batch: PackedBatch,
    loss: PolicyLoss,
    micro_batches: list[MicroBatch],
    *,
    lr: float,
    grad_clip: float,
    device: torch.device,
    world_size: int,
) -> dict[str, float]:
    """One critic optimizer step at `lr` (see `FSDPTrainer.train_value_step`); "critic/grad_norm"
    in the result is non-finite when the update was skipped."""
    assert batch.returns is not None
    weights = batch_loss_weights(batch)
    sums = MetricSums()
    policy_lp = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    optimizer.zero_grad(set_to_none=True)
    for mb in micro_batches:
        v = token_values(critic, mb)
        lp = per_token(policy_lp, mb, device)
        # No policy forward: the policy fields carry the batch's data, entropy 0.
        inputs = loss_inputs(batch, weights, mb, lp, torch.zeros_like(lp), device)
        old = batch.values
        inputs.values = v
        inputs.old_values = v.detach() if old is None else per_token(old, mb, device)
        inputs.returns = per_token(batch.returns, mb, device)
        per_tok, metrics = loss(inputs)
        (per_tok * inputs.loss_weights).sum().backward()
        sums.add("critic/loss", per_tok, inputs.loss_weights)
        for key, value in metrics.items():
            key = f"critic/{key.removeprefix('train/')}"
            if key in _CRITIC_METRICS:
                raise ValueError(f"loss metric {key!r} clashes with the trainer's own")
            sums.add(key, value, inputs.loss_weights)

    out = sums.reduce(weights, "critic/loss", world_size)
    params = [p for p in critic.parameters() if p.requires_grad]
    grad_norm = optimizer_step(params, optimizer, lr, grad_clip)
    out["critic/grad_norm"] = grad_norm
    out["critic/lr"] = lr
    return out
