"""The OpenAI API's streamed answers: server-sent events of chat.completion.chunk or
text_completion objects for every choice of a request (n samples of each prompt), one choice per
chunk, as SGLang and OpenAI send them.

Text goes out as it is generated, less what could still change: a trailing partial UTF-8
character, and a tail that could be the start of a stop string (a matched stop string is cut from
the answer, so it must never have been sent). Each chunk carries the logprobs (top logprobs when
asked) of the tokens it brings: those made since the choice's previous chunk, so a token whose
text is held back comes with the next chunk. Chat: each choice's role chunk first, then its
content, then a chunk of its own with an empty delta, finish_reason and matched_stop (SGLang's
order). Completions: with `echo` a choice's first chunk starts with the prompt (and with logprobs
carries the prompt's), its last carries finish_reason. With `return_token_ids` each chunk carries
the ids of the tokens it brings (`token_ids`; joined, the choice's answer) and a choice's first
chunk its `prompt_token_ids`. Usage: with `continuous_usage_stats` each chunk carries its choice's
counts so far; with `stream_options.include_usage` a last chunk of its own has the request's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool

from miles.serve.host import Finished
from miles.serve.serving import (
    Progress,
    ServeState,
    add_prompt_logprobs,
    answer,
    decode_text,
    submit,
)
from miles.sglang import openai
from miles.sglang.openai import OpenAIRequest
from miles.sglang.openai_chunks import chat_delta, hold_back
from miles.sglang.protocol import GenerateItem

_GOING = {"finish_reason": None, "matched_stop": None}  # a chunk before a choice's last


@dataclass
class _Running:
    index: int
    item: GenerateItem
    prompt: list[int]
    echo: str | None  # completions with echo: the prompt's text, sent in the first chunk
    progress: Progress
    wait: asyncio.Future[Finished]
    sent: str = ""  # text already streamed (past the echo)
    sent_tokens: int = 0  # tokens whose logprobs were streamed
    sent_ids: int = 0  # tokens whose ids were streamed (return_token_ids)
    ids_started: bool = False  # the choice's prompt_token_ids went out
    offset: int = 0  # completions' text_offset of the next token
    started: bool = False  # a chunk of text went out
    done: bool = False
    tokens: int = 0
    cached: int = 0


async def stream_choices(
    state: ServeState,
    request: OpenAIRequest,
    kind: str,
    rid: str,
    model: str,
    work: list[tuple[int, GenerateItem, list[int]]],
    text_of: Callable[[int], str],
) -> AsyncIterator[bytes]:
    """`work`: (choice index, item, prompt ids) per choice, not yet submitted."""
    loop = asyncio.get_running_loop()
    chat = kind == "chat.completion.chunk"
    running = []
    for index, item, ids in work:
        progress = Progress(loop)
        wait = submit(state, item, ids, progress.update)
        echo = None if chat else _echo(state, request, index)
        running.append(_Running(index, item, ids, echo, progress, wait))
    prompts = {id(r.prompt): r.prompt for r in running}

    def chunk(r: _Running, choice: dict[str, Any]) -> bytes:
        body = {**openai.envelope(kind, rid, model), "choices": [choice]}
        if request.continuous_usage:  # SGLang's: this choice's counts so far
            body["usage"] = openai.usage([r.prompt], [], r.cached, completion=r.tokens)
        return f"data: {json.dumps(body)}\n\n".encode()

    def usage_chunk() -> bytes:
        body = {**openai.envelope(kind, rid, model), "choices": []}
        body["usage"] = openai.usage(
            list(prompts.values()), [], sum(r.cached for r in running),
            completion=sum(r.tokens for r in running),
        )  # fmt: skip
        return f"data: {json.dumps(body)}\n\n".encode()

    try:
        if chat:  # each choice's role first, as OpenAI sends it
            for r in running:
                role = chat_delta("", role=True)
                first = {"index": r.index, "delta": role, "logprobs": None, **_GOING}
                yield chunk(r, {**first, **_token_ids(request, r, [])})
        while not all(r.done for r in running):
            pending = [r for r in running if not r.done]
            waiters = [asyncio.ensure_future(r.progress.changed.wait()) for r in pending]
            either: list[asyncio.Future[Any]] = [*waiters, *(r.wait for r in pending)]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            for r in pending:
                if r.wait.done():
                    for last in _last(state, request, r, chat, text_of):
                        yield chunk(r, last)
                elif r.progress.changed.is_set():
                    r.progress.changed.clear()
                    partial = _partial(state, request, r, chat, text_of)
                    if partial is not None:
                        yield chunk(r, partial)
        if request.include_usage:
            yield usage_chunk()
        yield b"data: [DONE]\n\n"
    finally:  # the client left early: stop what it no longer reads
        for r in running:
            if not r.wait.done():
                await run_in_threadpool(state.host.abort, r.item.rid, False)


def _echo(state: ServeState, request: OpenAIRequest, index: int) -> str | None:
    """The text `echo` sends before choice `index`'s answer (the non-streamed answer's)."""
    if not request.echo:
        return None
    prompt = request.prompts[index // request.n]
    return prompt if isinstance(prompt, str) else str(state.tokenizer.decode(prompt))


def _partial(
    state: ServeState, request: OpenAIRequest, r: _Running, chat: bool, text_of: Any
) -> dict[str, Any] | None:
    """A choice's chunk after a model step: the text it can send now (None: nothing new)."""
    p = r.progress
    r.tokens = len(p.ids)
    safe = hold_back(decode_text(state, r.item, p.ids), r.item.sampling.stop)
    if not (safe.startswith(r.sent) and len(safe) > len(r.sent)):
        return None
    piece, r.sent = safe[len(r.sent) :], safe
    so_far = Finished(
        r.item.rid, r.prompt, p.ids, p.logprobs, "", 0, top_logprobs=p.top_logprobs,
        prompt_logprobs=p.prompt_logprobs, prompt_top_logprobs=p.prompt_top_logprobs,
    )  # fmt: skip
    logprobs = _logprobs(request, r, so_far, chat, text_of)
    ids = _token_ids(request, r, p.ids)
    if chat:
        return {"index": r.index, "delta": chat_delta(piece), "logprobs": logprobs, **_GOING, **ids}
    return {"index": r.index, "text": _first(r) + piece, "logprobs": logprobs, **_GOING, **ids}


def _token_ids(request: OpenAIRequest, r: _Running, ids: list[int]) -> dict[str, Any]:
    """With `return_token_ids`: the ids among `ids` (the choice's tokens so far) that no earlier
    chunk carried, and in the choice's first chunk its prompt's ids."""
    if not request.body.get("return_token_ids"):
        return {}
    out: dict[str, Any] = {"token_ids": ids[r.sent_ids :]}
    if not r.ids_started:
        out["prompt_token_ids"] = r.prompt
    r.sent_ids, r.ids_started = max(r.sent_ids, len(ids)), True
    return out


def _first(r: _Running) -> str:
    """What a completions choice's text starts with: the echo in its first chunk."""
    first, r.started = not r.started, True
    return (r.echo or "") if first else ""


def _logprobs(
    request: OpenAIRequest, r: _Running, done: Finished, chat: bool, text_of: Any
) -> dict[str, Any] | None:
    """The logprobs of the tokens a choice's next chunk brings (those not yet sent), in the API's
    shape; with echo, a completions choice's first chunk has the prompt's first. None when the
    request asked for none."""
    if not request.logprobs:
        return None
    start, end = r.sent_tokens, len(done.response_ids)
    r.sent_tokens = end
    ids, lps = done.response_ids[start:end], done.logprobs[start:end]
    rows = [[lp, t, None] for lp, t in zip(lps, ids, strict=True)]
    meta: dict[str, Any] = {"output_token_logprobs": rows}
    if done.top_logprobs is not None:
        meta["output_top_logprobs"] = [
            [[lp, t, None] for t, lp in row] for row in done.top_logprobs[start:end]
        ]
    if chat:
        return openai.chat_logprobs({"meta_info": meta}, request.top_logprobs, text_of)
    echo_from = None
    if r.echo is not None and not r.started:
        add_prompt_logprobs(meta, r.item, done, lambda _: None)
        echo_from = 0
    out = openai.completion_logprobs({"meta_info": meta}, request.top_logprobs, text_of, echo_from)
    out["text_offset"] = [r.offset + at for at in out["text_offset"]]
    r.offset += sum(len(token) for token in out["tokens"])
    return out


def _last(
    state: ServeState, request: OpenAIRequest, r: _Running, chat: bool, text_of: Any
) -> list[dict[str, Any]]:
    """A choice's last chunks: the rest of its text with its tokens' logprobs, and
    finish_reason with matched_stop (chat: in a chunk of their own, after the text's)."""
    r.done = True
    done = r.wait.result()
    result = answer(state, r.item, done)
    r.tokens, r.cached = len(result["output_ids"]), done.cached_tokens
    text = result["text"]
    rest = text[len(r.sent) :] if text.startswith(r.sent) else ""
    logprobs = _logprobs(request, r, done, chat, text_of)
    end: dict[str, Any] = {
        "finish_reason": openai.finish(result),
        "matched_stop": openai.matched_stop(result),
    }
    if request.body.get("return_meta_info"):
        end["meta_info"] = result["meta_info"]
    ids = _token_ids(request, r, result["output_ids"])
    if not chat:
        return [{"index": r.index, "text": _first(r) + rest, "logprobs": logprobs, **end, **ids}]
    out = []
    if rest or (logprobs is not None and logprobs["content"]) or ids.get("token_ids"):
        text = {"index": r.index, "delta": chat_delta(rest), "logprobs": logprobs, **_GOING}
        out.append({**text, **ids})
    out.append({"index": r.index, "delta": chat_delta(None), "logprobs": None, **end})
    return out
