"""One agent episode's token record: every call the agent made, joined into the one token
sequence the trainer sees, with no re-tokenization of anything the model generated.

Each call's prompt must extend the sequence so far (the previous prompt and the tokens generated
for it). The new part (the assistant turn's closing tokens, then tool results or user messages)
is tokenized alone and masked out of the loss; generated tokens keep their ids, logprobs and
weight versions. A call whose prompt rewrites earlier turns cannot be joined: it is refused
(`Diverged`) and the episode fails with that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from miles.core.protocols import Tokenizer
from miles.core.types import GenerateResult, token_versions

_SENTINEL = "\x00miles-content\x00"


class Diverged(ValueError):
    """A call's prompt does not extend the episode's token sequence."""


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    def key(m: dict[str, Any]) -> tuple[str, str]:
        return str(m.get("role")), str(m.get("content") or "")

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


def _ids(encoded: Any) -> list[int]:
    if isinstance(encoded, Mapping):  # transformers 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


@dataclass
class Trajectory:
    tokenizer: Tokenizer
    prompt_ids: list[int] = field(default_factory=list)  # the first call's prompt
    response_ids: list[int] = field(default_factory=list)  # everything after it
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: npt.NDArray[np.integer[Any]] | None = None
    calls: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    diverged: str | None = None
    _generated: int = 0  # tokens the last call generated
    # What the last call left, to check that the next one extends it.
    _messages: list[dict[str, Any]] | None = None  # chat: its messages and the reply
    _text: str | None = None  # completions: its prompt text and the reply's text
    _chat_render: tuple[Any, dict[str, Any]] | None = None  # chat: (tools, template kwargs)

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    # -- the next call's prompt ----------------------------------------------------------------

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: Any, template_kwargs: dict[str, Any]
    ) -> list[int]:
        """The token ids to send for a chat call: the first call's rendered chat; later calls
        extend the sequence with the closing tokens of the last reply and the new messages."""
        render = (tools, template_kwargs)
        if self.calls == 0:
            return _ids(self._render(messages, render, generation=True, tokenize=True))
        prev = self._messages
        if prev is None or self._chat_render != render:
            self._diverge("it is a chat call after a completion call, or changed tools")
        assert prev is not None
        if len(messages) <= len(prev) or not _same(messages[: len(prev)], prev):
            self._diverge(
                "its messages do not start with the previous call's messages and the reply "
                "it returned"
            )
        before = self._render(prev, render, generation=False)
        now = self._render(messages, render, generation=True)
        if not now.startswith(before):
            self._diverge("the chat template renders the earlier turns differently now")
        return self.ids + self._closing(render) + self._encode(now[len(before) :])

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if self.calls and prompt[: len(self.ids)] != self.ids:
                self._diverge("its prompt token ids do not start with the episode's tokens")
            return list(prompt)
        if self.calls == 0:
            return self._encode(prompt)
        if self._text is None or not prompt.startswith(self._text):
            self._diverge("its prompt text does not start with the previous prompt and reply")
        assert self._text is not None
        return self.ids + self._encode(prompt[len(self._text) :])

    # -- recording a call ----------------------------------------------------------------------

    def record(self, prompt_ids: list[int], result: GenerateResult) -> None:
        """Appends one call: the new prompt tokens (mask 0), then the generated ones (mask 1)."""
        if self.calls == 0:
            self.prompt_ids = list(prompt_ids)
        else:
            new = prompt_ids[len(self.ids) :]
            last_version = self.versions[-1] if self.versions else 0
            self.response_ids += new
            self.loss_mask += [0] * len(new)
            self.logprobs += [0.0] * len(new)
            self.versions += [last_version] * len(new)
        n = len(result.response_ids)
        self.response_ids += result.response_ids
        self.loss_mask += [1] * n
        self.logprobs += result.logprobs
        self.versions += token_versions(result.weight_version, n)
        if result.routing is not None:  # covers this call's prompt and reply: all so far
            self.routing = result.routing
        self._generated = n
        self.calls += 1
        self.finish_reasons.append(result.finish_reason)

    def remember_chat(
        self,
        messages: list[dict[str, Any]],
        reply: str,
        tools: Any,
        template_kwargs: dict[str, Any],
    ) -> None:
        self._messages = [*messages, {"role": "assistant", "content": reply}]
        self._chat_render = (tools, template_kwargs)
        self._text = None

    def remember_completion(self, prompt: str | list[int], reply: str) -> None:
        self._text = prompt + reply if isinstance(prompt, str) else None
        self._messages = None

    def fitted_routing(self) -> npt.NDArray[np.integer[Any]] | None:
        """The routing record over exactly the sequence (tokens after the last reply: -1)."""
        n = len(self.ids)
        if self.routing is None or len(self.routing) == n:
            return self.routing
        out = np.full((n, *self.routing.shape[1:]), -1, dtype=self.routing.dtype)
        out[: min(n, len(self.routing))] = self.routing[:n]
        return out

    # -- helpers -------------------------------------------------------------------------------

    def _diverge(self, why: str) -> None:
        self.diverged = (
            f"call {self.calls + 1} of the episode cannot be trained on: {why}. Miles trains on "
            "one token sequence per sample: append to the conversation (never edit or drop "
            "earlier messages), or end the episode"
        )
        raise Diverged(self.diverged)

    def _encode(self, text: str) -> list[int]:
        return _ids(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _render(
        self,
        messages: list[dict[str, Any]],
        render: tuple[Any, dict[str, Any]],
        *,
        generation: bool,
        tokenize: bool = False,
    ) -> Any:
        tools, kwargs = render
        return self.tokenizer.apply_chat_template(
            messages,  # type: ignore[arg-type]
            tools=tools,
            add_generation_prompt=generation,
            tokenize=tokenize,
            **kwargs,
        )

    def _closing(self, render: tuple[Any, dict[str, Any]]) -> list[int]:
        """The tokens the chat template puts after an assistant message's content (ChatML:
        `<|im_end|>` and a newline), less the end-of-turn token when the model generated it."""
        probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = str(self._render(probe, render, generation=False))
        closing = self._encode(text[text.rfind(_SENTINEL) + len(_SENTINEL) :])
        if closing and self._generated and self.response_ids[-1] == closing[0]:
            return closing[1:]
        return closing
