"""The OpenAI API's streamed answers: server-sent events of chat.completion.chunk or
text_completion objects, for every choice of a request (n samples of each prompt) at once.

Text goes out as it is generated, less what could still change: a trailing partial UTF-8
character, and a tail that could be the start of a stop string (a matched stop string is cut from
the answer, so it must never have been sent). A choice's logprobs come in its last chunk, for all
its tokens: top logprobs exist only for the finished answer. Usage comes in a last chunk of its
own (`stream_options.include_usage`) or in every chunk (`continuous_usage_stats`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool

from miles.serve.host import Finished
from miles.serve.serving import Progress, ServeState, answer, submit
from miles.sglang import openai
from miles.sglang.openai import Choice, OpenAIRequest
from miles.sglang.openai_chunks import hold_back
from miles.sglang.protocol import GenerateItem


@dataclass
class _Running:
    index: int
    item: GenerateItem
    prompt: list[int]
    progress: Progress
    wait: asyncio.Future[Finished]
    sent: str = ""  # text already streamed
    done: bool = False
    tokens: int = 0
    cached: int = 0
    first: list[bool] = field(default_factory=lambda: [True])


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
    running = []
    for index, item, ids in work:
        progress = Progress(loop)
        running.append(
            _Running(index, item, ids, progress, submit(state, item, ids, progress.update))
        )
    chat = kind == "chat.completion.chunk"
    prompts = {id(r.prompt): r.prompt for r in running}

    def chunk(choices: list[dict[str, Any]], final_usage: bool = False) -> bytes:
        body = {**openai.envelope(kind, rid, model), "choices": choices}
        if request.continuous_usage or final_usage:
            body["usage"] = openai.usage(
                list(prompts.values()), [], sum(r.cached for r in running),
                completion=sum(r.tokens for r in running),
            )  # fmt: skip
        return f"data: {json.dumps(body)}\n\n".encode()

    def delta(r: _Running, text: str) -> dict[str, Any]:
        if not chat:
            return {"index": r.index, "text": text, "logprobs": None, "finish_reason": None}
        message: dict[str, Any] = {"content": text}
        if r.first[0]:
            message, r.first[0] = {"role": "assistant", **message}, False
        return {"index": r.index, "delta": message, "logprobs": None, "finish_reason": None}

    try:
        if chat:  # the role first, as OpenAI sends it
            yield chunk([delta(r, "") for r in running])
        while not all(r.done for r in running):
            pending = [r for r in running if not r.done]
            waiters = [asyncio.ensure_future(r.progress.changed.wait()) for r in pending]
            either: list[asyncio.Future[Any]] = [*waiters, *(r.wait for r in pending)]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            out = []
            for r in pending:
                if r.wait.done():
                    out.append(_last(state, request, r, chat, text_of))
                elif r.progress.changed.is_set():
                    r.progress.changed.clear()
                    r.tokens = len(r.progress.ids)
                    s = r.item.sampling
                    text = state.tokenizer.decode(
                        r.progress.ids, skip_special_tokens=s.skip_special_tokens
                    )
                    safe = hold_back(text, s.stop)
                    if safe.startswith(r.sent) and len(safe) > len(r.sent):
                        out.append(delta(r, safe[len(r.sent) :]))
                        r.sent = safe
            if out:
                yield chunk(out)
        if request.include_usage and not request.continuous_usage:
            yield chunk([], final_usage=True)
        yield b"data: [DONE]\n\n"
    finally:  # the client left early: stop what it no longer reads
        for r in running:
            if not r.wait.done():
                await run_in_threadpool(state.host.abort, r.item.rid, False)


def _last(
    state: ServeState, request: OpenAIRequest, r: _Running, chat: bool, text_of: Any
) -> dict[str, Any]:
    """A choice's last chunk: the rest of its text, its logprobs, finish_reason, matched_stop."""
    r.done = True
    done = r.wait.result()
    result = answer(state, r.item, done)
    r.tokens, r.cached = len(result["output_ids"]), done.cached_tokens
    text = result["text"]
    rest = text[len(r.sent) :] if text.startswith(r.sent) else ""
    choice = Choice(r.index, r.prompt, result)
    out: dict[str, Any] = {"index": r.index}
    if chat:
        message: dict[str, Any] = {"content": rest} if rest else {}
        if r.first[0]:
            message, r.first[0] = {"role": "assistant", **message}, False
        out["delta"] = message
        logprobs = (
            openai.chat_logprobs(result, request.top_logprobs, text_of)
            if request.logprobs
            else None
        )
    else:
        out["text"] = rest
        logprobs = (
            openai.completion_logprobs(result, request.top_logprobs, text_of, None)
            if request.logprobs
            else None
        )
    out["logprobs"] = logprobs
    out["finish_reason"] = openai.finish(result)
    out["matched_stop"] = openai.matched_stop(result)
    if request.body.get("return_token_ids"):
        out["token_ids"] = result["output_ids"]
        out["prompt_token_ids"] = choice.prompt
    if request.body.get("return_meta_info"):
        out["meta_info"] = result["meta_info"]
    return out
