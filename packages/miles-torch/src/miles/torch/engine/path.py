"""Which generation loop a `torch` engine runs (see `TorchEngineConfig.path`), and why."""

from __future__ import annotations

from typing import Any

import torch

from miles.torch.engine.config import EnginePath
from miles.torch.engine.paged.model import unsupported_reason


def choose_path(requested: EnginePath, device: torch.device, model: Any) -> tuple[str, str]:
    """("paged" or "hf", why); ValueError when paged is asked for and cannot run."""
    if requested == "hf":
        return "hf", "rollout.path is hf"
    reason = unsupported_reason(model)
    if requested == "paged":
        if reason is not None:
            raise ValueError(f"rollout.path is paged, but {reason}: use auto or hf")
        return "paged", "rollout.path is paged"
    if reason is not None:
        return "hf", reason
    if device.type != "cuda":
        return "hf", "auto runs the paged path on GPUs; on CPU the hf path (path: paged forces it)"
    return "paged", f"{model.config.model_type} has a paged forward"
