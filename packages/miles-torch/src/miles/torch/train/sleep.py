"""Sleep and wake: the trainer's weights and optimizer state leave the GPU while the rollout
engine generates (colocated placement), and come back for the next step.

On a CPU trainer there is nothing to free, so both are no-ops.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from miles.torch.train.host_adamw import HostAdamW


def to_host(
    models: Iterable[torch.nn.Module],
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
) -> None:
    """Move `models` and their `optimizers`' state from `device` to the host, and free the
    CUDA cache."""
    _move(models, optimizers, device, torch.device("cpu"))


def to_device(
    models: Iterable[torch.nn.Module],
    optimizers: Iterable[torch.optim.Optimizer],
    device: torch.device,
) -> None:
    """Undo `to_host`: move everything back onto `device`."""
    _move(models, optimizers, device, device)


def _move(
    models: Iterable[torch.nn.Module],
    optimizers: Iterable[torch.optim.Optimizer],
    home: torch.device,
    to: torch.device,
) -> None:
    if home.type == "cpu":
        return
    for model in models:
        model.to(to)
    for optimizer in optimizers:
        if isinstance(optimizer, HostAdamW):
            continue  # its moments rest on the host already
        for state in optimizer.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = value.to(to, non_blocking=True)
    torch.cuda.synchronize(home)
    if to.type == "cpu":
        torch.cuda.empty_cache()
