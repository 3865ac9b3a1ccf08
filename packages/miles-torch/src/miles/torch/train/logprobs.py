"""Per-token logprobs and entropies of one micro-batch, in the flat (packed) token layout."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from miles.torch.train.chunked_head import chunked_logprobs
from miles.torch.train.microbatch import MicroBatch


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), each fp32 [mb.num_tokens]; 0 at each sequence's first token.

    logprobs[t] = log_softmax(logits[t - 1] / temperature)[token t], entropy[t] is that
    distribution's entropy. Only the real (unpadded) positions go through the fp32 softmax, and
    for a model whose output head is a plain linear layer, a chunk of tokens at a time
    (`chunked_head`): the micro-batch's full-vocabulary logits never exist at once. The
    outputs carry gradients when grad mode is on, even for a micro-batch without predictions,
    so backward always reaches every layer (FSDP's reduce-scatters must run on every rank).
    """
    targets = mb.input_ids[mb.rows, mb.cols + 1]
    head = _plain_head(model)
    chunked = nullcontext() if head is None else _head_scores(head, mb, targets, temperature)
    with chunked:
        out = model(**mb.model_inputs(), use_cache=False)
    if head is not None:  # the head gave (logprob, entropy) per predicting token
        picked, entropy = out.logits[:, 0], out.logits[:, 1]
    else:
        logp = torch.log_softmax(out.logits[mb.rows, mb.cols].float() / temperature, dim=-1)
        picked = logp.gather(-1, targets[:, None]).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1)
    zeros = torch.zeros(mb.num_tokens, dtype=torch.float32, device=picked.device)
    return (
        zeros.index_put((mb.target_pos,), picked),
        zeros.index_put((mb.target_pos,), entropy),
    )


def _plain_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output layer when its logits are exactly `head(hidden)`: a linear layer, no
    soft-capping or scaling after it (None: the logits path)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, torch.nn.Linear):
        return None
    config = getattr(model, "config", None)
    for after in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, after, None) not in (None, 1, 1.0):
            return None
    return head


@contextmanager
def _head_scores(
    head: torch.nn.Linear, mb: MicroBatch, targets: torch.Tensor, temperature: float
) -> Iterator[None]:
    """While set, `head` maps the model's last hidden states [rows, cols, hidden] to the
    [predicting tokens, 2] (logprob, entropy) of `targets`. The result leaves through the
    model's output (as its "logits"), so hooks that wait for the gradient of the model's
    outputs (FSDP's pre-backward) see it. The head is called inside the model's forward,
    where sharded parameters are gathered."""

    def forward(hidden: torch.Tensor) -> Any:
        logprobs, entropy = chunked_logprobs(
            hidden[mb.rows, mb.cols], head.weight, head.bias, targets, temperature
        )
        return torch.stack([logprobs, entropy], dim=-1)

    own = head.__dict__.get("forward")  # a forward set on the instance before ours, if any
    head.forward = forward  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        if own is None:
            del head.forward  # back to the class's forward
        else:
            head.forward = own  # type: ignore[method-assign]
