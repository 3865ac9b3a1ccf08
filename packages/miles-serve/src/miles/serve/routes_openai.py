"""`miles serve`'s OpenAI-compatible endpoints: completions and chat completions (whole or
streamed, n samples of each prompt, logprobs with top-k, structured output), the models list, and
SGLang's /v1/score. The Responses API is in `responses_api.py`."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles.serve.openai_stream import stream_choices
from miles.serve.serving import (
    ServeState,
    answer,
    chat_prompt,
    check_serving,
    model_name,
    new_rid,
    prompt_ids,
    read_body,
    refuse_rejected,
    submit,
    vocab_size,
)
from miles.sglang import openai
from miles.sglang import protocol as wire
from miles.sglang.openai import Choice, OpenAIRequest
from miles.sglang.protocol import BadRequest, GenerateItem, NotFound, check_fields

SCORE_FIELDS: dict[str, tuple[type | None, ...]] = {
    "model": (str, None),
    "query": (str, list),
    "items": (str, list),
    "label_token_ids": (list,),
    "apply_softmax": (bool,),
    "item_first": (bool,),
}


def add_openai_routes(app: FastAPI, state: ServeState) -> None:
    settings = state.settings

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = openai.parse_completion(await read_body(request))
        check_serving(state)
        items = [_item(parsed, i, p) for i, p in enumerate(parsed.prompts)]
        prompts = [prompt_ids(state, item) for item in items]
        texts = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in parsed.prompts]
        return await _respond(state, parsed, "text_completion", items, prompts, texts)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = openai.parse_chat(await read_body(request))
        check_serving(state)
        ids = parsed.body.get("input_ids") or chat_prompt(state, parsed.body)
        item = _item(parsed, 0, ids)
        return await _respond(state, parsed, "chat.completion", [item], [prompt_ids(state, item)])

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [_card(state)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id != settings.model_path:
            raise NotFound(f"model {model_id!r} is not served here (GET /v1/models lists it)")
        return JSONResponse(_card(state))

    @app.post("/v1/score")
    async def score(request: Request) -> JSONResponse:
        body = check_fields(
            await read_body(request), SCORE_FIELDS, "/v1/score",
            required=("query", "items", "label_token_ids"),
        )  # fmt: skip
        check_serving(state)
        scores, prompt_tokens = await _score(state, body)
        return JSONResponse(
            {
                "scores": scores,
                "model": model_name(body, settings),
                "object": "scoring",
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )


def _card(state: ServeState) -> dict[str, Any]:
    path = state.settings.model_path
    return {
        "id": path,
        "object": "model",
        "created": int(state.started),
        "owned_by": "miles",
        "root": path,
        "parent": None,
        "max_model_len": state.max_context,
    }


def _item(parsed: OpenAIRequest, index: int, prompt: list[int] | str) -> GenerateItem:
    rid = parsed.body.get("rid") or new_rid()
    return GenerateItem(
        rid=rid if index == 0 else f"{rid}_{index}",
        sampling=parsed.sampling,
        input_ids=prompt if isinstance(prompt, list) else None,
        text=prompt if isinstance(prompt, str) else None,
        return_logprob=True,
        return_text_in_logprobs=False,
        top_logprobs_num=parsed.top_logprobs,
        logprob_start_len=0 if parsed.echo and parsed.logprobs else -1,
        cache_salt=parsed.cache_salt,
    )


def _samples(
    parsed: OpenAIRequest, items: list[GenerateItem], prompts: list[list[int]]
) -> list[tuple[int, GenerateItem, list[int]]]:
    """(choice index, item, prompt) for n samples of each prompt: OpenAI's index is i * n + j."""
    out = []
    for i, (item, ids) in enumerate(zip(items, prompts, strict=True)):
        for j in range(parsed.n):
            if parsed.n == 1:
                out.append((i, item, ids))
                continue
            sample = replace(
                item, rid=f"{item.rid}-{j}", sampling=wire.nth_sample(item.sampling, j)
            )
            out.append((i * parsed.n + j, sample, ids))
    return out


async def _respond(
    state: ServeState,
    parsed: OpenAIRequest,
    kind: str,
    items: list[GenerateItem],
    prompts: list[list[int]],
    prompt_texts: list[str] | None = None,
) -> Response:
    model = model_name(parsed.body, state.settings)
    work = _samples(parsed, items, prompts)
    rid = items[0].rid

    def text_of(token: int) -> str:
        return str(state.tokenizer.decode([token]))

    if parsed.stream:
        chunks = stream_choices(state, parsed, f"{kind}.chunk" if kind.startswith("chat") else kind,
                                rid, model, work, text_of)  # fmt: skip
        return StreamingResponse(chunks, media_type="text/event-stream")
    finished = await asyncio.gather(*(submit(state, item, ids) for _, item, ids in work))
    refuse_rejected(*finished)
    choices = [
        Choice(index, ids, answer(state, item, done))
        for (index, item, ids), done in zip(work, finished, strict=True)
    ]
    cached = sum(done.cached_tokens for done in finished)
    if kind == "chat.completion":
        out = [openai.chat_choice(parsed, c, text_of) for c in choices]
    else:
        assert prompt_texts is not None
        out = [
            openai.completion_choice(parsed, c, text_of, prompt_texts[c.index // parsed.n])
            for c in choices
        ]
    return JSONResponse(
        {
            **openai.envelope(kind, rid, model),
            "choices": out,
            "usage": openai.usage(prompts, choices, cached),
        }
    )


def _token_list(state: ServeState, value: Any, what: str) -> list[int]:
    if isinstance(value, str):
        return list(state.tokenizer(value, add_special_tokens=False)["input_ids"])
    if isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        return list(value)
    raise BadRequest(f"/v1/score: {what} must be a string or a list of token ids")


async def _score(state: ServeState, body: dict[str, Any]) -> tuple[list[list[float]], int]:
    """SGLang's scoring: for each item, the probability of each label token coming next after
    query + item (item + query with item_first), renormalised over the labels with
    apply_softmax. One prompt-logprob request per (item, label), the label appended."""
    labels = body["label_token_ids"]
    vocab = vocab_size(state)
    if not labels or not all(isinstance(t, int) and not isinstance(t, bool) for t in labels):
        raise BadRequest("/v1/score: label_token_ids must be a non-empty list of token ids")
    for token in labels:  # SGLang's words
        if not 0 <= token < (vocab or 1 << 62):
            raise BadRequest(f"Token ID {token} is out of vocabulary (vocab size: {vocab})")
    query = _token_list(state, body["query"], "query")
    raw_items = body["items"] if isinstance(body["items"], list) else [body["items"]]
    if raw_items and all(isinstance(t, int) for t in raw_items):
        raw_items = [raw_items]  # one item given as token ids
    if not raw_items:
        raise BadRequest("/v1/score: items is empty")
    items = [_token_list(state, item, "items[i]") for item in raw_items]
    joined = [item + query if body.get("item_first") else query + item for item in items]
    requests = []
    for ids in joined:
        for label in labels:
            item = GenerateItem(
                rid=new_rid(),
                sampling=wire.Sampling(max_new_tokens=1),
                input_ids=[*ids, label],
                return_logprob=True,
                logprob_start_len=len(ids),
            )
            prompt_ids(state, item)
            requests.append(submit(state, item, item.input_ids or []))
    finished = await asyncio.gather(*requests)
    refuse_rejected(*finished)
    scores = []
    for i in range(len(joined)):
        row = []
        for j in range(len(labels)):
            lps = finished[i * len(labels) + j].prompt_logprobs or []
            if not lps:
                raise RuntimeError("the engine returned no prompt logprobs for /v1/score")
            row.append(lps[-1])
        if body.get("apply_softmax"):
            top = max(row)
            total = sum(math.exp(x - top) for x in row)
            scores.append([math.exp(x - top) / total for x in row])
        else:
            scores.append([math.exp(x) for x in row])
    return scores, sum(len(ids) for ids in joined)
