"""Typed config sections of the loss components. No torch import here: listing stays cheap.

Each field is a key the user writes next to the component's name, e.g.
``algorithm: {loss: {name: ppo_clip, clip_high: 0.28}}``. Invalid values raise in
``__post_init__``, which the config loader reports with the key's path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Level = Literal["token", "sequence"]


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


def _bounds(low: float, high: float) -> None:
    if not 0 <= low < 1 < high:
        raise ValueError(f"need 0 <= low < 1 < high, got low={low}, high={high}")


def _clip_range(clip_low: float, clip_high: float) -> None:
    """The ratio's trust region [1 - clip_low, 1 + clip_high] must contain 1 and stay positive."""
    if not (0 < clip_low <= 1 and clip_high > 0):
        raise ValueError(
            f"need 0 < clip_low <= 1 and clip_high > 0, got clip_low={clip_low}, "
            f"clip_high={clip_high}"
        )


# ── advantage estimators ─────────────────────────────────────────────────────────────────────────


@dataclass
class GRPOConfig:
    # Divide by the group's reward std; off gives Dr.GRPO's unnormalised advantages.
    normalize_std: bool = True
    eps: float = 1e-6


@dataclass
class RLOOConfig:
    pass


@dataclass
class ReinforcePPConfig:
    # Subtract the group mean before whitening over the batch (`reinforce_pp_baseline`).
    baseline: bool = False
    eps: float = 1e-6


@dataclass
class GAEConfig:
    gamma: float = 1.0  # discount per token
    lam: float = 1.0  # GAE's lambda: 1 gives Monte-Carlo returns minus V, 0 gives one-step TD

    def __post_init__(self) -> None:
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"gamma and lam must lie in [0, 1], got {self.gamma}, {self.lam}")


# ── policy and auxiliary losses ──────────────────────────────────────────────────────────────────


@dataclass
class PPOClipConfig:
    clip_low: float = 0.2  # ratio floor is 1 - clip_low
    clip_high: float = 0.2  # ratio ceiling is 1 + clip_high (clip-higher: make it larger)
    # Dual-clip (Ye et al. 2020): for A < 0 the loss is at most dual_clip * |A|. None: off.
    dual_clip: float | None = None

    def __post_init__(self) -> None:
        _clip_range(self.clip_low, self.clip_high)
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"dual_clip must be greater than 1, got {self.dual_clip}")


@dataclass
class GSPOConfig:
    # GSPO clips a sequence-level ratio, a geometric mean, so its bounds are far tighter than PPO's.
    clip_low: float = 3e-4
    clip_high: float = 4e-4

    def __post_init__(self) -> None:
        _clip_range(self.clip_low, self.clip_high)


@dataclass
class CISPOConfig:
    # IS weight is clip(ratio, 1 - clip_low, 1 + clip_high), detached. MiniMax-M1 leaves the
    # lower bound off (None) and tunes only the upper one; 4.0 caps the weight at 5, the value
    # ScaleRL and TRL recommend.
    clip_low: float | None = None
    clip_high: float = 4.0

    def __post_init__(self) -> None:
        if self.clip_low is not None and not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must lie in [0, 1) or be null, got {self.clip_low}")
        _positive("clip_high", self.clip_high)


@dataclass
class SFTConfig:
    pass


@dataclass
class ValueConfig:
    # Values move at most `clip` from the values they had when the data was scored (PPO's
    # clipped value loss). None: plain squared error.
    clip: float | None = 0.2

    def __post_init__(self) -> None:
        if self.clip is not None:
            _positive("clip", self.clip)


# ── train–inference mismatch corrections ─────────────────────────────────────────────────────────


@dataclass
class TISConfig:
    level: Level = "token"  # "sequence": one weight per sequence, the product of token ratios
    cap: float = 2.0  # weights are min(ratio, cap)

    def __post_init__(self) -> None:
        _positive("cap", self.cap)


@dataclass
class MISConfig:
    level: Level = "token"
    low: float = 0.5  # tokens (or sequences) whose ratio leaves [low, high] are masked out
    high: float = 2.0

    def __post_init__(self) -> None:
        _bounds(self.low, self.high)


@dataclass
class IcePopConfig:
    # The Ring-1T paper's [alpha, beta] = [0.5, 5].
    low: float = 0.5
    high: float = 5.0

    def __post_init__(self) -> None:
        _bounds(self.low, self.high)
