"""Prompt encoding: data rows to token ids, once per prompt, through the chat template.

Tokens in, tokens out: a prompt is tokenized here and never again; the rollout engines, rewards
and the trainer all work from these ids.
"""

from __future__ import annotations

from typing import Any

from miles.core.config import DataConfig, WarmstartConfig
from miles.core.contracts.protocols import Tokenizer
from miles.core.contracts.types import PackedBatch, Sample


class PromptEncoder:
    def __init__(self, tokenizer: Tokenizer, data: DataConfig) -> None:
        self.tokenizer, self.data = tokenizer, data

    def encode(self, rows: list[dict[str, Any]], key: str | None = None) -> list[list[int]]:
        """Token ids of each row's prompt field (`data.prompt_key` by default), in one batched
        call; chat-templated unless `data.chat_template: false`."""
        key = key or self.data.prompt_key
        for row in rows:
            if key not in row:
                raise KeyError(
                    f"data row has no {key!r} field (fields: {sorted(row)}); set data.prompt_key"
                )
        prompts = [row[key] for row in rows]
        if self.data.chat_template:
            system = self.data.system_prompt
            chats = [
                [*([{"role": "system", "content": system}] if system else []), *_messages(p)]
                for p in prompts
            ]
            texts: Any = self.tokenizer.apply_chat_template(
                chats, add_generation_prompt=True, tokenize=False
            )
        else:
            texts = [_plain_text(p) for p in prompts]
        # The rendered template already holds every special token it wants.
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def sft_batch(self, rows: list[dict[str, Any]], warmstart: WarmstartConfig) -> PackedBatch:
        """A warm-start batch: each prompt (templated like RL prompts) plus its response tokens
        and EOS, trained on the response only."""
        prompts = self.encode(rows, warmstart.prompt_key)
        responses = self.tokenizer(
            [str(r[warmstart.response_key]) for r in rows], add_special_tokens=False
        )["input_ids"]
        eos = self.tokenizer.eos_token_id
        samples = [
            Sample(prompt_ids=p, response_ids=[*r, *([int(eos)] if eos is not None else [])])
            for p, r in zip(prompts, responses, strict=True)
        ]
        return PackedBatch.from_samples(samples)


def _messages(prompt: Any) -> list[dict[str, str]]:
    """A prompt field as chat messages: a string is one user message; a list of
    {"role", "content"} messages (as in many RL datasets) is taken as it is."""
    if not isinstance(prompt, list):
        return [{"role": "user", "content": str(prompt)}]
    if all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in prompt):
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    raise ValueError(
        f"data prompt must be a string or a list of {{role, content}} messages, got "
        f"{str(prompt)[:80]!r}"
    )


def _plain_text(prompt: Any) -> str:
    if not isinstance(prompt, list):
        return str(prompt)
    raise ValueError(
        "data.chat_template: false needs prompts that are strings; this one is a list of "
        "messages: set data.chat_template: true"
    )
