"""`format`: 1.0 when the response is laid out as tagged blocks, by default
`<think>...</think>` then `<answer>...</answer>` (the R1-Zero / TinyZero format).

Strict: the response is exactly those blocks, in order, each once, separated only by whitespace.
Lenient: the blocks appear in order; other text may surround them.

Chat templates that open `<think>` in the prompt (Qwen3, DeepSeek-R1) leave the response without
the opening tag: use `tags: [answer]` or `strict: false` there.
"""

from __future__ import annotations

import re

from miles.core.contracts.types import Sample
from miles.rewards.configs import FormatConfig


class Format:
    reward_range: tuple[float, float] = (0.0, 1.0)
    deterministic: bool = True

    def __init__(self, config: FormatConfig) -> None:
        self.config = config
        blocks = [rf"<{t}>(?:(?!</?{t}>).)*?</{t}>" for t in config.tags]
        if config.strict:
            self._pattern = re.compile(r"\s*" + r"\s*".join(blocks) + r"\s*", re.DOTALL)
        else:
            self._pattern = re.compile(".*?".join(blocks), re.DOTALL)
        # Strict also forbids a tag reappearing after its block (e.g. a second <answer>).
        self._any_tag = re.compile("|".join(rf"</?{t}>" for t in config.tags))

    async def __call__(self, response: str, sample: Sample) -> float:
        if self.config.strict:
            ok = self._pattern.fullmatch(response) is not None
            ok = ok and len(self._any_tag.findall(response)) == 2 * len(self.config.tags)
        else:
            ok = self._pattern.search(response) is not None
        return 1.0 if ok else 0.0
