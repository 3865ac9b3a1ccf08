"""One micro-batch's forward, and megatron-core's pipeline schedule over a batch's micro-batches.

The last pipeline stage turns its hidden states into logprobs and entropy through the
vocabulary-parallel head (`miles.megatron.head`, `miles.megatron.logprobs`): no [tokens, vocab]
logits are made, and what the schedule hands the loss is a [2, tokens] tensor. Other stages hand
their hidden states on. The schedule is `get_forward_backward_func` (1F1B at PP > 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from miles.megatron.head import output_weight
from miles.megatron.logprobs import vocab_parallel_logprobs
from miles.megatron.replay import RoutingReplay
from miles.torch.train.microbatch import MicroBatch

# A micro-batch and its last-stage output ([2, tokens]: logprobs, entropy) -> (the loss to
# backpropagate, what to report from the last stage).
LossOf = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


@dataclass(frozen=True)
class StageForward:
    """The forward of this rank's pipeline stage, as megatron-core's schedule calls it."""

    last_stage: bool
    tp_rank: int
    vocab_size: int  # the model's, without the padding to a multiple of TP
    temperature: float
    replay: RoutingReplay | None

    def __call__(self, model: Any, mb: MicroBatch) -> torch.Tensor:
        """[2, mb.num_tokens] (logprobs, entropy) on the last stage; hidden states elsewhere."""
        assert mb.cu_seq_lens is not None and mb.position_ids is not None
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seq_lens,
            cu_seqlens_kv=mb.cu_seq_lens,
            max_seqlen_q=mb.max_seq_len,
            max_seqlen_kv=mb.max_seq_len,
        )
        if self.replay is not None:
            self.replay.set_record(mb.routing)
        out: torch.Tensor = model(mb.input_ids, mb.position_ids, None, packed_seq_params=packed)
        if not self.last_stage:
            return out
        hidden = out.reshape(-1, out.shape[-1])
        weight = output_weight(model.module)
        targets = mb.input_ids[0, mb.target_pos]
        lp, entropy = vocab_parallel_logprobs(
            hidden[mb.target_pos - 1],
            weight,
            targets,
            vocab_start=self.tp_rank * weight.shape[0],
            vocab_size=self.vocab_size,
            temperature=self.temperature,
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        zeros = torch.zeros(mb.num_tokens, 2, dtype=torch.float32, device=lp.device)
        return zeros.index_put((mb.target_pos,), torch.stack([lp, entropy], dim=1)).t()


def run_schedule(
    ddp: Any,
    forward: StageForward,
    mbs: list[MicroBatch],
    loss_of: LossOf,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Runs the micro-batches through megatron-core's schedule; what `loss_of` reported for
    each, on the last stage (an empty list elsewhere)."""

    def forward_step(data: Iterator[MicroBatch], model: Any) -> tuple[torch.Tensor, Any]:
        mb = next(data)
        return forward(model, mb), partial(_loss_func, loss_of, mb)

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(mbs),
        model=[ddp],
        num_microbatches=len(mbs),
        seq_length=max(mb.num_tokens for mb in mbs),
        micro_batch_size=1,
        forward_only=forward_only,
    )
    return list(out) if out else []


def _loss_func(
    loss_of: LossOf, mb: MicroBatch, output: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """megatron-core's loss function contract: (loss, tokens it counts, reported); padding
    micro-batches count no tokens."""
    loss, reported = loss_of(mb, output)
    tokens = torch.tensor(0 if mb.is_padding else mb.num_tokens, dtype=torch.int)
    return loss, tokens.to(output.device), reported
