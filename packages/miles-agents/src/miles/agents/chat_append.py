"""What a chat call adds to an agent episode: the chat template's rendering of the new messages
alone, in the conversation's context, after the ids the engine generated for the last reply.

Templates render an assistant turn differently once more messages follow it: Qwen3 writes an
empty `<think>\\n\\n</think>\\n\\n` on the last assistant turn only and drops the reasoning of turns
before the last user query; DeepSeek-R1 drops the reasoning of every earlier turn. Rendering the
history again and comparing it with the episode's tokens would refuse every such conversation,
and training on a fresh rendering would train on tokens the model never saw. So the history is
never rendered into the sequence again: the last reply's content is replaced by a marker, the
conversation with the new messages is rendered once, and the text after the marker (what closes
the reply, then the new messages, then the generation prompt) is what the call appends.

A second rendering, with markers for the new messages' contents, checks that the template puts
every new message after the reply, in order: DeepSeek's templates gather all system messages at
the top, and such a conversation cannot be one growing token sequence.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.core.contracts.protocols import Tokenizer

REPLY = "MilesReplyMarker"  # stands for the last reply's content
_NEW = "MilesNewMessage{}Marker"  # stands for the content of new message i

# The call's `tools` and `chat_template_kwargs`: a template renders with both.
Render = tuple[Any, dict[str, Any]]


class NotAppendable(ValueError):
    """The chat template cannot render the new messages as an append to the conversation."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def ids_of(encoded: Any) -> list[int]:
    if isinstance(encoded, Mapping):  # transformers 5 returns a BatchEncoding
        encoded = encoded["input_ids"]
    return [int(t) for t in encoded]


def render(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    how: Render,
    *,
    generation: bool,
    tokenize: bool = False,
) -> Any:
    tools, kwargs = how
    return tokenizer.apply_chat_template(
        messages,  # type: ignore[arg-type]
        tools=tools,
        add_generation_prompt=generation,
        tokenize=tokenize,
        **kwargs,
    )


def after_reply(
    tokenizer: Tokenizer,
    history: list[dict[str, Any]],
    new: list[dict[str, Any]],
    how: Render,
    *,
    generation: bool = True,
) -> str:
    """The text the chat template puts after the content of `history`'s last message (the
    model's reply) when `new` follows it: the reply's closing tokens (ChatML: `<|im_end|>` and
    a newline), `new`, and with `generation` the generation prompt."""
    head = [*history[:-1], {"role": "assistant", "content": REPLY}]
    text = _render_once(tokenizer, head + new, how, generation)
    if new:
        _check_order(tokenizer, head, new, how, generation)
    return text[text.index(REPLY) + len(REPLY) :]


def encode_after(tokenizer: Tokenizer, text: str, last_generated: int | None) -> list[int]:
    """`text` (from `after_reply`) as token ids, less its first token when that is the token the
    model ended its reply with (the end-of-turn token it generated)."""
    ids = ids_of(tokenizer.encode(text, add_special_tokens=False)) if text else []
    if ids and last_generated is not None and ids[0] == last_generated:
        return ids[1:]
    return ids


def _render_once(
    tokenizer: Tokenizer, messages: list[dict[str, Any]], how: Render, generation: bool
) -> str:
    """The rendering, which must hold the reply marker exactly once."""
    try:
        text = str(render(tokenizer, messages, how, generation=generation))
    except Exception as exc:  # the template's own raise_exception, or content it cannot take
        raise NotAppendable(
            "template_error",
            f"the chat template cannot render the conversation with the new messages "
            f"({type(exc).__name__}: {exc})",
        ) from None
    if text.count(REPLY) != 1:
        raise NotAppendable(
            "template_dropped_reply",
            "the chat template does not render the last reply's content exactly once, so the "
            "tokens after it cannot be found",
        )
    return text


def _check_order(
    tokenizer: Tokenizer,
    head: list[dict[str, Any]],
    new: list[dict[str, Any]],
    how: Render,
    generation: bool,
) -> None:
    """Every new message with text content is rendered after the reply, in order."""
    marked = [
        {**m, "content": _NEW.format(i)} if isinstance(m.get("content"), str) else m
        for i, m in enumerate(new)
    ]
    text = _render_once(tokenizer, head + marked, how, generation)
    at = text.index(REPLY)
    for i, message in enumerate(new):
        if not isinstance(message.get("content"), str):
            continue
        found = text.find(_NEW.format(i), at)
        if found < 0:
            raise NotAppendable(
                "template_moves_messages",
                f"the chat template does not render new message {i} "
                f"({message.get('role')}) after the last reply: it moves it (DeepSeek's "
                "templates gather every system message at the top) or drops it, so the "
                "conversation cannot grow as one token sequence",
            )
        at = found
