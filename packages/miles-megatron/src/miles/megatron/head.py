"""Logprobs and entropy of target tokens from a GPTModel, straight from its last hidden states.

Megatron's output layer would make [tokens, vocab / tp] logits in the compute dtype, which the
loss then turns into fp32 log-softmaxes: the largest activation of an RL step. Miles' GPTModel
has its output layer pass the hidden states through instead (`bypass_output_layer`), and
`token_logprobs` runs the vocabulary-parallel, chunked log-softmax of `miles.megatron.logprobs`
on the output weight (or the tied embedding) itself.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from miles.megatron.logprobs import vocab_parallel_logprobs


def _pass_hidden(self: Any, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[Any, None]:
    return hidden, None


def bypass_output_layer(model: Any) -> None:
    """The model's forward returns its final (normed) hidden states [batch, seq, hidden] in
    place of logits; the output layer keeps its weight, which `token_logprobs` uses."""
    if getattr(model, "post_process", True):
        model.output_layer.forward = types.MethodType(_pass_hidden, model.output_layer)


def output_weight(model: Any) -> torch.Tensor:
    """This tensor rank's rows of the output projection (the embedding's, when tied)."""
    if model.share_embeddings_and_output_weights:
        weight: torch.Tensor = model.shared_embedding_or_output_weight()
    else:
        weight = model.output_layer.weight
    return weight


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    packed_seq_params: PackedSeqParams | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), fp32, shaped like `targets` (the token each position predicts, as
    global ids), over the real vocabulary (`vocab_size`: Megatron's padding rows left out), for a
    model whose output layer is bypassed."""
    hidden = model(input_ids, position_ids, None, packed_seq_params=packed_seq_params)
    weight = output_weight(model)
    rank = parallel_state.get_tensor_model_parallel_rank()
    logprobs, entropy = vocab_parallel_logprobs(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        vocab_start=rank * weight.shape[0],
        vocab_size=vocab_size,
        temperature=temperature,
        group=parallel_state.get_tensor_model_parallel_group(),
    )
    return logprobs.view(targets.shape), entropy.view(targets.shape)
