"""Generalised advantage estimation (Schulman et al. 2016) over packed sequences.

Only a sequence's masked (trained) tokens form its trajectory: prompt tokens and tool outputs
between turns are skipped, so the next state's value after a response token is the value of the
next *trained* token, and after the last one it is 0 (the episode ends).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]


def compute_gae(
    token_rewards: F32,
    values: F32,
    offsets: npt.NDArray[np.int64],
    mask: F32,
    gamma: float,
    lam: float,
) -> tuple[F32, F32]:
    """Per-token advantages and returns (advantage + value); both 0 off the mask.

    delta_t = r_t + gamma * V_{t+1} - V_t and A_t = delta_t + gamma * lam * A_{t+1}, over each
    sequence's masked tokens. The recursion runs once over positions, vectorised over sequences.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    n = len(offsets) - 1
    seq = np.repeat(np.arange(n), np.diff(offsets))
    tokens = np.flatnonzero(np.asarray(mask) > 0)
    adv = np.zeros(len(mask), dtype=np.float64)
    if len(tokens) == 0:
        return adv.astype(np.float32), adv.astype(np.float32)
    # Lay each sequence's masked tokens out as a row of an [n, L + 1] grid; the extra column (and
    # any padding after a row's end) holds zeros: the value after the last token.
    s = seq[tokens]
    counts = np.bincount(s, minlength=n)
    pos = np.arange(len(tokens)) - (np.cumsum(counts) - counts)[s]
    width = int(counts.max())
    r = np.zeros((n, width + 1))
    v = np.zeros((n, width + 1))
    r[s, pos] = token_rewards[tokens]
    v[s, pos] = values[tokens]
    delta = r[:, :width] + gamma * v[:, 1:] - v[:, :width]
    grid = np.zeros((n, width + 1))
    for t in range(width - 1, -1, -1):
        grid[:, t] = delta[:, t] + gamma * lam * grid[:, t + 1]
    adv[tokens] = grid[s, pos]
    returns = np.zeros_like(adv)
    returns[tokens] = adv[tokens] + values[tokens]
    return adv.astype(np.float32), returns.astype(np.float32)


def terminal_rewards(
    rewards: F32, offsets: npt.NDArray[np.int64], mask: F32
) -> npt.NDArray[np.float32]:
    """Per-token rewards with each sequence's scalar reward on its last masked token, 0 elsewhere
    (outcome rewards as GAE's token rewards). A sequence with no masked token drops its reward."""
    n = len(offsets) - 1
    seq = np.repeat(np.arange(n), np.diff(offsets))
    out = np.zeros(len(mask), dtype=np.float32)
    tokens = np.flatnonzero(np.asarray(mask) > 0)
    if len(tokens):
        last = np.full(n, -1)
        np.maximum.at(last, seq[tokens], tokens)
        has = last >= 0
        out[last[has]] = np.asarray(rewards, dtype=np.float32)[has]
    return out
