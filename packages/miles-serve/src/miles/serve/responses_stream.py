"""The Responses API's stream (`POST /v1/responses` with `stream: true`): OpenAI's server-sent
events, each `event: TYPE` with its JSON `data` and a `sequence_number`:

    response.created, response.in_progress             the response, status in_progress
    response.output_item.added, response.content_part.added   the message and its output_text
    response.output_text.delta ...                      the text as it is generated
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed                                  the whole response, with usage

Text goes out less what could still change (a partial UTF-8 character, a possible stop string's
start), as on chat. An answer the engine refuses ends the stream with `response.failed`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from miles.serve.host import Finished
from miles.serve.serving import Progress, ServeState, decode_text, submit
from miles.sglang.openai_chunks import hold_back
from miles.sglang.protocol import GenerateItem

# (the finished answer) -> the final response object
Finish = Callable[[Finished], dict[str, Any]]


async def stream_response(
    state: ServeState,
    item: GenerateItem,
    prompt: list[int],
    opening: dict[str, Any],
    finish: Finish,
) -> AsyncIterator[bytes]:
    """`opening`: the response object before any output (status in_progress)."""
    progress = Progress(asyncio.get_running_loop())
    wait = submit(state, item, prompt, progress.update)
    sequence = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal sequence
        data = {"type": kind, "sequence_number": sequence, **fields}
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()

    message_id = f"msg_{item.rid}"
    at = {"item_id": message_id, "output_index": 0, "content_index": 0}
    try:
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        open_item = {"id": message_id, "type": "message", "status": "in_progress",
                     "role": "assistant", "content": []}  # fmt: skip
        yield event("response.output_item.added", output_index=0, item=open_item)
        yield event("response.content_part.added", **at, part=output_text_part(""))
        sent = ""
        while not wait.done():
            changed = asyncio.ensure_future(progress.changed.wait())
            either: list[asyncio.Future[Any]] = [changed, wait]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            if wait.done():
                break
            progress.changed.clear()
            safe = hold_back(decode_text(state, item, progress.ids), item.sampling.stop)
            if safe.startswith(sent) and len(safe) > len(sent):
                yield event("response.output_text.delta", **at, delta=safe[len(sent) :],
                            logprobs=[])  # fmt: skip
                sent = safe
        response = finish(wait.result())
        if response["status"] == "failed":
            yield event("response.failed", response=response)
            return
        done_item = response["output"][0]
        text = done_item["content"][0]["text"]
        if text.startswith(sent) and len(text) > len(sent):
            yield event("response.output_text.delta", **at, delta=text[len(sent) :], logprobs=[])
        yield event("response.output_text.done", **at, text=text, logprobs=[])
        yield event("response.content_part.done", **at, part=output_text_part(text))
        yield event("response.output_item.done", output_index=0, item=done_item)
        yield event("response.completed", response=response)
    finally:  # the client left early: stop what it no longer reads
        if not wait.done():
            await run_in_threadpool(state.host.abort, item.rid, False)


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
