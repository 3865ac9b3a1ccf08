"""Generation endpoints of `miles serve`: SGLang's /generate, the OpenAI API, health."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles.serve.host import NotServing, QueueFull
from miles.serve.serving import (
    Progress,
    ServeState,
    answer,
    check_serving,
    error,
    new_rid,
    prompt_ids,
    read_body,
    refuse_rejected,
    stream_answer,
    submit,
)
from miles.sglang import protocol as wire
from miles.sglang.protocol import BadRequest, GenerateItem


def add_generation_routes(app: FastAPI, state: ServeState) -> None:
    settings = state.settings
    # -- generation ----------------------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        call = wire.parse_generate(await read_body(request), new_rid)
        if not settings.record_routing and any(i.return_routed_experts for i in call.items):
            raise BadRequest(
                "return_routed_experts: this server records no routes (start miles serve with "
                "--record-routing, on a MoE model)"
            )
        check_serving(state)
        prompts = [prompt_ids(state, item) for item in call.items]
        if call.stream:  # one prompt (the parser refuses a streamed batch)
            item, ids = call.items[0], prompts[0]
            progress = Progress(asyncio.get_running_loop())
            wait = submit(state, item, ids, progress.update)
            return StreamingResponse(
                stream_answer(state, item, len(ids), wait, progress), media_type="text/event-stream"
            )
        waits = [submit(state, item, ids) for item, ids in zip(call.items, prompts, strict=True)]
        done = await asyncio.gather(*waits)
        refuse_rejected(*done)
        answers = [answer(state, item, f) for item, f in zip(call.items, done, strict=True)]
        return JSONResponse(answers if call.batch else answers[0])

    @app.get("/health")
    async def health() -> Response:
        ok = bool(state.engine.health().get("ok", True))
        return Response(status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state.host.paused or state.released:
            return error(503, "paused or memory released: not generating")
        item = GenerateItem(rid=new_rid(), sampling=wire.Sampling(max_new_tokens=1))
        first = int(state.tokenizer.bos_token_id or state.tokenizer.eos_token_id or 0)
        try:
            finished = await asyncio.wait_for(submit(state, item, [first]), timeout=60)
        except (TimeoutError, NotServing, QueueFull) as exc:
            return error(503, f"the engine did not generate: {exc}")
        return Response(status_code=200 if finished.error is None else 503)
