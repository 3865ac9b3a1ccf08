"""Typed config sections of the loss components. No torch import here: listing stays cheap."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GRPOConfig:
    # Divide by the group's reward std; off gives Dr.GRPO's unnormalised advantages.
    normalize_std: bool = True
    eps: float = 1e-6


@dataclass
class PPOClipConfig:
    clip_low: float = 0.2  # ratio floor is 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (clip-higher: make it larger)


@dataclass
class SFTConfig:
    pass
