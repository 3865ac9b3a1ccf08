"""Which tensors make up a model's weights, for sync and checksums, on both sides alike."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def named_state(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once, under their first name) and persistent buffers, by
    `state_dict()` name. The trainer sends exactly this set and the engine hashes exactly it."""
    persistent = set(model.state_dict().keys())
    yield from model.named_parameters()
    for name, buf in model.named_buffers():
        if name in persistent:
            yield name, buf
