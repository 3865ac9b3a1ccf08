"""`overlong`: DAPO's soft overlong punishment (Yu et al., 2025, "DAPO: An Open-Source LLM
Reinforcement Learning System at Scale", arXiv:2503.14476, section 3.4, "Overlong Reward Shaping").

With L the response's token count, L_max = `max_len` and L_cache = `buffer`:

    R(L) = 0                                  if L <= L_max - L_cache
         = ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
         = -1                                 if L > L_max

It is a length penalty, not a task score: DAPO adds it to the correctness reward. Set `max_len` to
the rollout's `max_new_tokens` (DAPO: 20480 with a 4096 buffer) so only truncation-bound answers
are punished in full.
"""

from __future__ import annotations

from miles.core.contracts.types import Sample
from miles.rewards.configs import OverlongConfig


def overlong_penalty(length: int, max_len: int, buffer: int) -> float:
    free = max_len - buffer
    if length <= free:
        return 0.0
    if length <= max_len:
        return (free - length) / buffer
    return -1.0


class Overlong:
    reward_range: tuple[float, float] = (-1.0, 0.0)
    deterministic: bool = True

    def __init__(self, config: OverlongConfig) -> None:
        self.config = config

    async def __call__(self, response: str, sample: Sample) -> float:
        # Tokens, not characters: the budget the engine enforces is in tokens.
        return overlong_penalty(len(sample.response_ids), self.config.max_len, self.config.buffer)
