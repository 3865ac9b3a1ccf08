"""Per-token critic values of one micro-batch, in the flat (packed) token layout."""

from __future__ import annotations

import torch

from miles.torch.train.microbatch import MicroBatch


def token_values(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """fp32 [mb.num_tokens]: values[t] = the critic's output at position t - 1, 0 at each
    sequence's first token.

    The value of token t is that of the state before t is generated, the same alignment as
    `token_logprobs`. `model` is a token-classification model with one label. Like the logprobs,
    the output carries gradients (when grad mode is on) even for a micro-batch without
    predictions, so backward reaches every layer on every rank.
    """
    out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    picked = out[mb.rows, mb.cols, 0].float()
    zeros = torch.zeros(mb.num_tokens, dtype=torch.float32, device=out.device)
    return zeros.index_put((mb.target_pos,), picked)
