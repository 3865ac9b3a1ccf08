"""OpenAI's Responses API (`POST /v1/responses`), the call agent SDKs now make, over the same
engine: `input` (a string, or messages whose content is a string or input_text parts) and
`instructions` rendered with the chat template; one `message` output item with `output_text`.

Responses are stored (unless `store: false`) in a bounded memory (`responses_store`):
`previous_response_id` continues one, `GET /v1/responses/{id}` returns it and `DELETE` forgets it.
`stream: true` sends OpenAI's events (`responses_stream`). An answer cut by `max_output_tokens` is
`status: "completed"` as SGLang answers, its message item `incomplete` (OpenAI's item status).
Built-in tools are refused (`docs/serve.md` lists them). Function tools go to the chat template
like chat's `tools`; their calls come back as the model's text. SGLang's sampling extras of this
endpoint (`frequency_penalty`, `presence_penalty`, `repetition_penalty`, `top_k`, `min_p`,
`stop`) and `chat_template_kwargs` are honoured as on chat. Errors are the Responses API's nested
object (`openai.responses_error_body`).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from miles.serve.host import Finished
from miles.serve.responses_store import ResponseStore, check_id
from miles.serve.responses_stream import output_text_part, stream_response
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
)
from miles.sglang import protocol as wire
from miles.sglang.protocol import BadRequest, GenerateItem, check_fields

RESPONSES_FIELDS: dict[str, tuple[type | None, ...]] = {
    "model": (str, None),
    "input": (str, list),
    "instructions": (str, None),
    "max_output_tokens": (int, None),
    "temperature": (float, int, None),
    "top_p": (float, int, None),
    "tools": (list, None),
    "tool_choice": (str, dict, None),
    "text": (dict, None),
    "metadata": (dict, None),
    "user": (str, None),
    "store": (bool, None),
    "stream": (bool, None),
    "previous_response_id": (str, None),
    "parallel_tool_calls": (bool, None),
    "truncation": (str, None),
    "background": (bool, None),
    # SGLang's extras of its ResponsesRequest.
    "frequency_penalty": (float, int, None),
    "presence_penalty": (float, int, None),
    "repetition_penalty": (float, int, None),
    "top_k": (int, None),
    "min_p": (float, int, None),
    "stop": (str, list, None),
    "chat_template_kwargs": (dict, None),
}
# Body fields that are /generate sampling_params of the same name.
_SAMPLING_KEYS = ("temperature", "top_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "top_k", "min_p", "stop")  # fmt: skip
_WHERE = "/v1/responses"


def add_responses_route(app: FastAPI, state: ServeState) -> None:
    store = ResponseStore()

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> JSONResponse | StreamingResponse:
        body = check_fields(await read_body(request), RESPONSES_FIELDS, _WHERE, required=("input",))
        _refuse_unsupported(body)
        check_serving(state)
        previous = body.get("previous_response_id")
        history = store.conversation(previous) if previous is not None else []
        conversation = [*history, *_input_messages(body)]
        instructions = body.get("instructions")
        system = [{"role": "system", "content": instructions}] if instructions else []
        ids = chat_prompt(
            state,
            {
                "messages": [*system, *conversation],
                "tools": _function_tools(body),
                "chat_template_kwargs": body.get("chat_template_kwargs"),
            },
        )
        item = GenerateItem(rid=new_rid(), sampling=_sampling(body), input_ids=ids)
        prompt = prompt_ids(state, item)

        def finish(done: Finished) -> dict[str, Any]:
            response = _response(state, body, item, answer(state, item, done), done)
            if body.get("store") is not False:  # OpenAI's default: stored
                store.put(response, conversation)
            return response

        if body.get("stream"):
            opening = _envelope(state, body, item, "in_progress")
            events = stream_response(state, item, prompt, opening, finish)
            return StreamingResponse(events, media_type="text/event-stream")
        done = await submit(state, item, prompt)
        refuse_rejected(done)
        return JSONResponse(finish(done))

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(store.get(response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _sampling(body: dict[str, Any]) -> wire.Sampling:
    sampling = wire.parse_sampling(
        {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}, _WHERE
    )
    sampling.max_new_tokens = body.get("max_output_tokens")
    fmt = (body.get("text") or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":  # the Responses API flattens the schema
        sampling.response_format = {"type": "json_schema", "json_schema": fmt}
    elif fmt:
        sampling.response_format = fmt
    return sampling


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("background"):
        raise BadRequest(f"{_WHERE}: background is not supported by miles serve (the answer is "
                         "made while the call waits; stream: true sends it as it comes)",
                         param="background")  # fmt: skip
    previous = body.get("previous_response_id")
    if previous is not None:
        check_id(previous)
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadRequest(f"{_WHERE}: built-in tool {kind!r} is not supported (function "
                             "tools only)")  # fmt: skip


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: content part {kind!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise BadRequest(f"{where}: content must be a string or a list of input_text parts")


def _input_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`input` as chat messages (`instructions` are not among them: they are not carried over to
    a continuation, as OpenAI's)."""
    messages: list[dict[str, Any]] = []
    given = body["input"]
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    for i, entry in enumerate(given):
        where = f"{_WHERE} input[{i}]"
        if not isinstance(entry, dict) or entry.get("type", "message") != "message":
            kind = entry.get("type") if isinstance(entry, dict) else type(entry).__name__
            raise BadRequest(f"{where}: item type {kind!r} is not supported (messages only)")
        role = entry.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise BadRequest(f"{where}: role must be user, assistant, system or developer")
        role = "system" if role == "developer" else role
        messages.append({"role": role, "content": _text_of(entry.get("content"), where)})
    return messages


def _function_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    return [
        {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools
    ]


def _envelope(
    state: ServeState, body: dict[str, Any], item: GenerateItem, status: str
) -> dict[str, Any]:
    """The response object's fields that do not depend on the answer."""
    return {
        "id": f"resp_{item.rid}",
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "incomplete_details": None,
        "error": None,
        "model": model_name(body, state.settings),
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "previous_response_id": body.get("previous_response_id"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "store": body.get("store") is not False,
        "output": [],
        "usage": None,
    }


def _response(
    state: ServeState, body: dict[str, Any], item: GenerateItem, result: dict[str, Any], done: Any
) -> dict[str, Any]:
    kind = result["meta_info"]["finish_reason"]["type"]
    failed = kind not in ("stop", "length")
    output_tokens = len(result["output_ids"])
    response = _envelope(state, body, item, "failed" if failed else "completed")
    if failed:
        response["error"] = {"code": "server_error", "message": done.error or "aborted"}
    response["output"] = [
        {
            "type": "message",
            "id": f"msg_{item.rid}",
            "status": "incomplete" if kind == "length" else "completed",
            "role": "assistant",
            "content": [output_text_part(result["text"])],
        }
    ]
    response["usage"] = {
        "input_tokens": len(done.prompt_ids),
        "input_tokens_details": {"cached_tokens": done.cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(done.prompt_ids) + output_tokens,
        # SGLang's names of the same counts (its usage is the chat UsageInfo).
        "prompt_tokens": len(done.prompt_ids),
        "completion_tokens": output_tokens,
    }
    return response
