"""Pieces of the OpenAI API's streams that need no engine: what text is safe to send yet, and the
stream of an answer that was generated whole (the agent gateway's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from miles.sglang import openai
from miles.sglang.openai import Choice, OpenAIRequest


def hold_back(text: str, stops: tuple[str, ...]) -> str:
    """`text` less what may still change: a partial character, a possible stop string's start."""
    text = text.rstrip("\ufffd")
    keep = len(text)
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:size]):
                keep = min(keep, len(text) - size)
                break
        if stop in text:
            keep = min(keep, text.find(stop))
    return text[:keep]


def chat_delta(content: str | None, role: bool = False) -> dict[str, Any]:
    """A chat chunk's delta as SGLang serializes it: reasoning_content and tool_calls are always
    there (null here: miles serve parses neither), so clients may read them off any chunk; the
    role only in each choice's first chunk; content null in the last one (finish_reason)."""
    delta: dict[str, Any] = {"role": "assistant"} if role else {}
    return {**delta, "content": content, "reasoning_content": None, "tool_calls": None}


def finished_stream(
    request: OpenAIRequest, kind: str, model: str, choice: Choice, text_of: Callable[[int], str]
) -> list[bytes]:
    """The stream of an answer generated whole (the agent gateway's: its engines answer a call
    at once): the role, the text token by token, the last chunk with finish_reason, logprobs
    and matched_stop, the usage when asked, `[DONE]`."""
    result, chat = choice.answer, kind == "chat.completion.chunk"
    rid = str(result["meta_info"]["id"])
    text, pieces, sent = result["text"], [], ""
    for n in range(1, len(result["output_ids"]) + 1):
        so_far = hold_back("".join(text_of(t) for t in result["output_ids"][:n]), ())
        if text.startswith(so_far) and len(so_far) > len(sent):
            pieces.append(so_far[len(sent) :])
            sent = so_far
    if text[len(sent) :]:
        pieces.append(text[len(sent) :])

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body = {**openai.envelope(kind, rid, model), "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n".encode()

    def part(piece: str, first: bool = False) -> dict[str, Any]:
        if not chat:
            return {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
        delta = chat_delta(piece, role=first)
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}

    usage = openai.usage(
        [choice.prompt], [choice], int(result["meta_info"].get("cached_tokens", 0))
    )
    every = usage if request.continuous_usage else None
    out = [event([part("", first=True)], every)] if chat else []
    out += [event([part(piece)], every) for piece in pieces]
    last: dict[str, Any] = {"index": 0, "finish_reason": openai.finish(result)}
    if chat:
        last["delta"] = chat_delta(None)
        last["logprobs"] = (
            openai.chat_logprobs(result, request.top_logprobs, text_of)
            if request.logprobs
            else None
        )
    else:
        last["text"] = ""
        last["logprobs"] = (
            openai.completion_logprobs(result, request.top_logprobs, text_of, None)
            if request.logprobs
            else None
        )
    last["matched_stop"] = openai.matched_stop(result)
    if request.body.get("return_token_ids"):
        last["token_ids"] = result["output_ids"]
        last["prompt_token_ids"] = choice.prompt
    out.append(event([last], every))
    if request.include_usage:  # SGLang's: the total in a last chunk, continuous or not
        out.append(event([], usage))
    out.append(b"data: [DONE]\n\n")
    return out
