"""The critic (value model): loading it from a policy or critic checkpoint, and its per-token
values of one micro-batch, in the flat (packed) token layout."""

from __future__ import annotations

import torch
from transformers import AutoModelForTokenClassification

from miles.torch.train.microbatch import MicroBatch


def token_values(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """fp32 [mb.num_tokens]: values[t] = the critic's output at position t - 1, 0 at each
    sequence's first token.

    The value of token t is that of the state before t is generated, the same alignment as
    `token_logprobs`. `model` is a token-classification model with one label. Like the logprobs,
    the output carries gradients (when grad mode is on) even for a micro-batch without
    predictions, so backward reaches every layer on every rank.
    """
    out = model(**mb.model_inputs(), use_cache=False).logits
    picked = out[mb.rows, mb.cols, 0].float()
    zeros = torch.zeros(mb.num_tokens, dtype=torch.float32, device=out.device)
    return zeros.index_put((mb.target_pos,), picked)


def load_critic(path: str, attn_implementation: str, seed: int = 0) -> torch.nn.Module:
    """The value model: `path`'s transformer with a one-output token-classification head.

    A policy checkpoint has no head (`score`): it is initialised here from `seed` alone, so
    every rank (and every world size) starts from the same head. N(0, 1/(hidden + 1)) keeps the
    initial values small without zeroing the gradient that reaches the transformer. A critic
    checkpoint (our `critic/` directory) loads its own head.
    """
    model, info = AutoModelForTokenClassification.from_pretrained(
        path,
        num_labels=1,
        dtype=torch.float32,
        attn_implementation=attn_implementation,
        output_loading_info=True,
    )
    head = model.score
    missing = set(info["missing_keys"])
    if "score.weight" in missing:
        gen = torch.Generator().manual_seed(seed)
        std = 1.0 / (head.in_features + 1)
        with torch.no_grad():
            head.weight.copy_(torch.randn(head.weight.shape, generator=gen) * std)
            if head.bias is not None:
                head.bias.zero_()
    # Saved configs then name the class that loads them.
    model.config.architectures = [type(model).__name__]
    critic: torch.nn.Module = model
    return critic
