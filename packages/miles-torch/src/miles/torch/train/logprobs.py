"""Per-token logprobs and entropies of one micro-batch, in the flat (packed) token layout."""

from __future__ import annotations

import torch

from miles.torch.train.microbatch import MicroBatch


def token_logprobs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), each fp32 [mb.num_tokens]; 0 at each sequence's first token.

    logprobs[t] = log_softmax(logits[t - 1] / temperature)[token t], entropy[t] is that
    distribution's entropy. Only the real (unpadded) positions go through the fp32 softmax. The
    outputs carry gradients when grad mode is on, even for a micro-batch without predictions,
    so backward always reaches every layer (FSDP's reduce-scatters must run on every rank).
    """
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    scaled = logits[mb.rows, mb.cols].float() / temperature  # [K, V]
    logp = torch.log_softmax(scaled, dim=-1)
    targets = mb.input_ids[mb.rows, mb.cols + 1]
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zeros = torch.zeros(mb.num_tokens, dtype=torch.float32, device=logits.device)
    return (
        zeros.index_put((mb.target_pos,), picked),
        zeros.index_put((mb.target_pos,), entropy),
    )
