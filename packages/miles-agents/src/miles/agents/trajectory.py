"""One agent episode's token record: every call the agent made, joined into the one token
sequence the trainer sees, with no re-tokenization of anything the model generated.

Each call's prompt extends the sequence so far (the previous prompt and the tokens generated for
it). A chat call's new part is what the chat template renders after the last reply (its closing
tokens, the new messages, the generation prompt: `chat_append`), tokenized alone and masked out of
the loss; generated tokens keep their ids, logprobs and weight versions, thinking tokens included,
whatever a fresh rendering of the conversation would make of them. A call that rewrites earlier
turns cannot be joined: it is refused (`Diverged`, with a one-word `reason`) and the episode
fails with that reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from miles.agents import chat_append
from miles.agents.chat_append import NotAppendable, Render, ids_of
from miles.core.contracts.protocols import Tokenizer
from miles.core.contracts.types import GenerateResult, token_versions


class Diverged(ValueError):
    """A call's prompt does not extend the episode's token sequence; `reason` says why in a word
    (the rollout counts them as `agent/refused/<reason>`)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def _content(message: dict[str, Any]) -> str:
    return str(message.get("content") or "")


def _same(sent: list[dict[str, Any]], kept: list[dict[str, Any]]) -> bool:
    """Whether the agent sent back the conversation it had: the same roles and contents, except
    that the last reply may come back without its reasoning (`<think>...</think>`), which Qwen3's
    and DeepSeek's templates drop themselves (the sample keeps the tokens the model generated)."""
    if len(sent) != len(kept) or not kept:
        return False
    if any(a.get("role") != b.get("role") for a, b in zip(sent, kept, strict=True)):
        return False
    if any(_content(a) != _content(b) for a, b in zip(sent[:-1], kept[:-1], strict=True)):
        return False
    back, reply = _content(sent[-1]), _content(kept[-1])
    return back == reply or (
        "</think>" in reply and back.strip() == reply.split("</think>")[-1].strip()
    )


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
    diverged: str | None = None  # why a call was refused, in full
    refused: str | None = None  # ... and in a word
    _generated: int = 0  # tokens the last call generated
    # What the last call left, to check that the next one extends it.
    _messages: list[dict[str, Any]] | None = None  # chat: its messages and the reply
    _text: str | None = None  # completions: its prompt text and the reply's text
    _chat_render: Render | None = None  # chat: (tools, template kwargs)
    _paired: bool = True  # the prompt being generated is its messages' rendering
    _unpaired_call: int = 0  # the last call whose input_ids were not its messages' rendering

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    # -- the next call's prompt ----------------------------------------------------------------

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: Any, template_kwargs: dict[str, Any]
    ) -> list[int]:
        """The token ids to send for a chat call: the first call's rendered chat; later calls
        append what the chat template renders after the last reply (`chat_append`)."""
        ids = self._refusing(self._chat_ids, messages, (tools, template_kwargs))
        self._paired = True
        return ids

    def input_ids_prompt(
        self,
        input_ids: list[int],
        messages: list[dict[str, Any]],
        tools: Any,
        template_kwargs: dict[str, Any],
    ) -> list[int]:
        """A chat call with its own `input_ids`: they must extend the episode's tokens. When
        they are exactly what `chat_prompt` gives for its messages, the messages are kept, so a
        later call may send messages again; otherwise a later messages call is refused."""
        ids = self.completion_prompt(input_ids)
        try:
            self._paired = self._chat_ids(messages, (tools, template_kwargs)) == ids
        except Exception:  # refused, or the template cannot render them: not their rendering
            self._paired = False
        return ids

    def completion_prompt(self, prompt: str | list[int]) -> list[int]:
        return self._refusing(self._completion_ids, prompt)

    def _chat_ids(self, messages: list[dict[str, Any]], render: Render) -> list[int]:
        if self.calls == 0:
            return ids_of(
                chat_append.render(self.tokenizer, messages, render, generation=True, tokenize=True)
            )
        prev = self._messages
        if prev is None:
            if self._unpaired_call:
                raise self._refusal(
                    "messages_after_input_ids",
                    f"it sends messages, but call {self._unpaired_call} sent input_ids that are "
                    "not the chat template's rendering of its messages, so the episode's tokens "
                    "do not follow from messages any more: keep sending input_ids (the last "
                    "prompt_token_ids and token_ids, then your new tokens)",
                )
            raise self._refusal("mixed_api", "it is a chat call after a completion call")
        if self._chat_render != render:
            raise self._refusal(
                "changed_template_args",
                "its tools or chat_template_kwargs are not the previous call's",
            )
        if len(messages) <= len(prev) or not _same(messages[: len(prev)], prev):
            raise self._refusal(
                "edited_history",
                "its messages do not start with the previous call's messages and the reply it returned",
            )
        try:
            text = chat_append.after_reply(self.tokenizer, prev, messages[len(prev) :], render)
        except NotAppendable as exc:
            raise self._refusal(exc.reason, str(exc)) from None
        return self.ids + self._encode_after(text)

    def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if self.calls and prompt[: len(self.ids)] != self.ids:
                raise self._refusal(
                    "token_prefix", "its prompt token ids do not start with the episode's tokens"
                )
            return list(prompt)
        if self.calls == 0:
            return self._encode(prompt)
        if self._text is None or not prompt.startswith(self._text):
            raise self._refusal(
                "text_prefix", "its prompt text does not start with the previous prompt and reply"
            )
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
        """After a chat call: its messages and reply, which the next call must extend (unless
        its prompt was input_ids that are not their rendering: then only input_ids may follow)."""
        self._text = None
        if not self._paired:
            self._messages, self._chat_render, self._unpaired_call = None, None, self.calls
            return
        self._messages = [*messages, {"role": "assistant", "content": reply}]
        self._chat_render = (tools, template_kwargs)

    def remember_completion(self, prompt: str | list[int], reply: str) -> None:
        self._text = prompt + reply if isinstance(prompt, str) else None
        self._messages, self._unpaired_call = None, 0

    def retemplate_drift(self) -> bool | None:
        """Whether the chat template, rendering the episode's final conversation afresh, gives
        other tokens than the episode's (what training on a re-rendered conversation would have
        changed); None when the episode did not end with a chat call."""
        if self._messages is None or self._chat_render is None or not self.calls:
            return None
        render = self._chat_render
        try:
            fresh = chat_append.render(
                self.tokenizer, self._messages, render, generation=False, tokenize=True
            )
            closing = chat_append.after_reply(
                self.tokenizer, self._messages, [], render, generation=False
            )
        except Exception:  # a metric: it never fails an episode
            return None
        return ids_of(fresh) != self.ids + self._encode_after(closing)

    def fitted_routing(self) -> npt.NDArray[np.integer[Any]] | None:
        """The routing record over exactly the sequence (tokens after the last reply: -1)."""
        n = len(self.ids)
        if self.routing is None or len(self.routing) == n:
            return self.routing
        out = np.full((n, *self.routing.shape[1:]), -1, dtype=self.routing.dtype)
        out[: min(n, len(self.routing))] = self.routing[:n]
        return out

    # -- helpers -------------------------------------------------------------------------------

    def _refusing(self, build: Callable[..., list[int]], *args: Any) -> list[int]:
        """`build(*args)`, recording a refusal on the episode."""
        try:
            ids = build(*args)
        except Diverged as exc:
            self.refused, self.diverged = exc.reason, str(exc)
            raise
        return ids

    def _refusal(self, reason: str, why: str) -> Diverged:
        return Diverged(
            reason,
            f"call {self.calls + 1} of the episode cannot be trained on ({reason}): {why}. Miles "
            "trains on one token sequence per sample: append to the conversation (never edit or "
            "drop earlier messages), or end the episode",
        )

    def _encode(self, text: str) -> list[int]:
        return ids_of(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _encode_after(self, text: str) -> list[int]:
        last = self.response_ids[-1] if self._generated and self.response_ids else None
        return chat_append.encode_after(self.tokenizer, text, last)
