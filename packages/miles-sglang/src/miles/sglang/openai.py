"""OpenAI-compatible completions and chat completions, with SGLang's extensions, translated to
and from the engine's terms: parsing a body into sampling and prompts, and building the response
objects (whole, and the chunks of a stream) from /generate answers. The routes live in
`routes_openai.py`.

SGLang's extensions: `return_token_ids` (a choice's `token_ids`, and `prompt_token_ids`),
`return_prompt_token_ids`, `return_meta_info` (the /generate `meta_info` on each choice), chat's
`input_ids` (a prompt already tokenized, so an agent's turns train on exactly the tokens the model
saw) and `continue_final_message`, `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_regex`, `no_stop_trim`, `regex`, `ebnf`, `json_schema`, and `matched_stop` on each choice.
OpenAI's `logit_bias` ({"token id": bias}) is SGLang's sampling_params `logit_bias`.

Errors: SGLang's `ErrorResponse` (`error_body`) on these endpoints, and on /v1/responses the nested
object OpenAI's Responses API answers (`responses_error_body`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from miles.sglang import protocol as wire
from miles.sglang.protocol import BadRequest, Sampling, check_fields

_COMMON: dict[str, tuple[type | None, ...]] = {
    "model": (str, None),
    "max_tokens": (int, None),
    "max_completion_tokens": (int, None),
    "temperature": (float, int, None),
    "top_p": (float, int, None),
    "top_k": (int, None),
    "min_p": (float, int, None),
    "n": (int, None),
    "stop": (str, list, None),
    "stop_token_ids": (list, None),
    "stop_regex": (str, list, None),
    "seed": (int, None),
    "stream": (bool, None),
    "stream_options": (dict, None),
    "user": (str, None),
    "frequency_penalty": (float, int, None),
    "presence_penalty": (float, int, None),
    "repetition_penalty": (float, int, None),
    "ignore_eos": (bool,),
    "no_stop_trim": (bool,),
    "response_format": (dict, None),
    "regex": (str, None),
    "ebnf": (str, None),
    "json_schema": (str, None),
    "return_token_ids": (bool,),
    "return_prompt_token_ids": (bool,),
    "return_meta_info": (bool,),
    "skip_special_tokens": (bool,),
    "rid": (str, None),
    "logit_bias": (dict, None),
    "cache_salt": (str, None),
}
COMPLETION_FIELDS: dict[str, tuple[type | None, ...]] = {
    **_COMMON,
    "prompt": (str, list),
    "logprobs": (int, None),
    "echo": (bool,),
}
CHAT_FIELDS: dict[str, tuple[type | None, ...]] = {
    **_COMMON,
    "messages": (list,),
    "input_ids": (list, None),
    "logprobs": (bool, None),
    "top_logprobs": (int, None),
    "tools": (list, None),
    "tool_choice": (str, dict, None),
    "chat_template_kwargs": (dict, None),
    # SGLang's: the last message, the assistant's, is continued (no new assistant turn opened).
    "continue_final_message": (bool,),
}
# OpenAI and SGLang fields this server does not implement: accepted at their defaults only, else
# a 400 naming the field (docs/serve.md says why each is missing).
_UNSUPPORTED = ("best_of", "suffix", "parallel_tool_calls", "min_tokens",
                "separate_reasoning", "stream_reasoning", "reasoning_effort", "modalities",
                "audio", "prediction", "structural_tag", "lora_path")  # fmt: skip
STREAM_OPTION_FIELDS: dict[str, tuple[type | None, ...]] = {
    "include_usage": (bool, None),
    "continuous_usage_stats": (bool, None),
}
COMPLETION_RESPONSE_FIELDS = ("id", "object", "created", "model", "choices", "usage")
COMPLETION_CHOICE_FIELDS = ("index", "text", "logprobs", "finish_reason", "matched_stop")
CHAT_CHOICE_FIELDS = ("index", "message", "logprobs", "finish_reason", "matched_stop")
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details")
MAX_COMPLETION_LOGPROBS = 20
# Body fields that are /generate sampling_params of the same name.
_SAMPLING_KEYS = ("top_k", "min_p", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
                  "no_stop_trim", "skip_special_tokens", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "regex", "ebnf", "json_schema", "logit_bias")  # fmt: skip


@dataclass
class OpenAIRequest:
    """A checked completions or chat body."""

    body: dict[str, Any]
    sampling: Sampling  # max_new_tokens None: up to the context length
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    echo: bool = False
    prompts: list[list[int] | str] = field(default_factory=list)  # completions only
    cache_salt: str | None = None


def _sampling(body: dict[str, Any], where: str) -> Sampling:
    max_tokens = body.get("max_completion_tokens")
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    if max_tokens is not None and max_tokens < 0:
        raise BadRequest(f"{where}: max_tokens must be >= 0, got {max_tokens}")
    params = {k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None}
    if body.get("temperature") is not None:
        params["temperature"] = body["temperature"]
    if body.get("top_p") is not None:
        params["top_p"] = body["top_p"]
    if body.get("seed") is not None:
        params["sampling_seed"] = body["seed"]
    sampling = wire.parse_sampling(params, where)
    sampling.max_new_tokens = max_tokens
    sampling.response_format = body.get("response_format")
    return sampling


def _common(body: dict[str, Any], where: str) -> OpenAIRequest:
    n = 1 if body.get("n") is None else body["n"]
    wire.check_n(n, where)
    options = check_fields(
        body.get("stream_options") or {}, STREAM_OPTION_FIELDS, f"{where} stream_options"
    )
    if options and not body.get("stream"):
        raise BadRequest(f"{where}: stream_options needs stream: true")
    return OpenAIRequest(
        body=body,
        sampling=_sampling(body, where),
        n=n,
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")),
        cache_salt=wire.check_cache_salt(body.get("cache_salt"), where),
    )


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def parse_completion(body: Any) -> OpenAIRequest:
    where = "/v1/completions"
    b = check_fields(body, COMPLETION_FIELDS, where, _UNSUPPORTED, ("prompt",))
    prompt = b["prompt"]
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts: list[list[int] | str] = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all((isinstance(p, str) and p) or _is_ids(p) for p in prompt)
    ):
        prompts = list(prompt)  # a batch: strings or token-id lists
    else:
        raise BadRequest(
            f"{where}: prompt must be a non-empty string, token ids, or a list of either"
        )
    if prompts == [""]:
        raise BadRequest(f"{where}: an empty prompt")
    request = _common(b, where)
    k = b.get("logprobs")
    if k is not None and not 0 <= k <= MAX_COMPLETION_LOGPROBS:
        raise BadRequest(f"{where}: logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {k}")
    request.logprobs, request.top_logprobs = k is not None, k or 0
    request.echo = bool(b.get("echo"))
    request.prompts = prompts
    return request


def parse_chat(body: Any) -> OpenAIRequest:
    where = "/v1/chat/completions"
    b = check_fields(body, CHAT_FIELDS, where, _UNSUPPORTED, ("messages",))
    for i, message in enumerate(b["messages"]):
        if not isinstance(message, dict) or "role" not in message:
            raise BadRequest(f"{where}: messages[{i}] needs a 'role'")
    ids = b.get("input_ids")
    if ids is not None and not _is_ids(ids):
        raise BadRequest(f"{where}: input_ids must be a non-empty list of integers")
    choice = b.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise BadRequest(
            f"{where}: tool_choice {choice!r} needs a tool-call parser, which is model-specific "
            "and not in miles serve: the model's raw text comes back as content "
            "(tool_choice 'auto' or 'none')"
        )
    request = _common(b, where)
    k = b.get("top_logprobs")
    if k is not None and not 0 <= k <= wire.MAX_TOP_LOGPROBS:
        raise BadRequest(f"{where}: top_logprobs must be in [0, {wire.MAX_TOP_LOGPROBS}], got {k}")
    if k and not b.get("logprobs"):
        raise BadRequest(f"{where}: top_logprobs needs logprobs: true")
    request.logprobs, request.top_logprobs = bool(b.get("logprobs")), k or 0
    return request


# -- responses ---------------------------------------------------------------------------------


@dataclass
class Choice:
    """One sample of one prompt: its index among the response's choices, its prompt ids and its
    /generate answer (with logprobs, top logprobs when asked)."""

    index: int
    prompt: list[int]
    answer: dict[str, Any]


def finish(answer: dict[str, Any]) -> str:
    kind = str(answer["meta_info"]["finish_reason"]["type"])
    return kind if kind in ("stop", "length") else "abort"


def matched_stop(answer: dict[str, Any]) -> int | str | None:
    reason = answer["meta_info"]["finish_reason"]
    return reason.get("matched") if reason.get("type") == "stop" else None


def usage(
    prompts: list[list[int]], choices: list[Choice], cached: int, completion: int | None = None
) -> dict[str, Any]:
    """Token counts: each distinct prompt once (n samples share it), every choice's output."""
    prompt_tokens = sum(len(p) for p in prompts)
    if completion is None:
        completion = sum(len(c.answer["output_ids"]) for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _extras(request: OpenAIRequest, out: dict[str, Any], choice: Choice) -> None:
    body = request.body
    if body.get("return_token_ids"):
        out["token_ids"] = choice.answer["output_ids"]
        out["prompt_token_ids"] = choice.prompt
    if body.get("return_prompt_token_ids"):
        out["prompt_token_ids"] = choice.prompt
    if body.get("return_meta_info"):
        out["meta_info"] = choice.answer["meta_info"]


def chat_logprobs(answer: dict[str, Any], top: int, text_of: Any) -> dict[str, Any]:
    """OpenAI's chat logprobs object: per output token its text, logprob, bytes and top-k."""
    meta = answer["meta_info"]
    tops = meta.get("output_top_logprobs") or [[] for _ in meta["output_token_logprobs"]]

    def entry(lp: float, token: int) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **entry(lp, token),
                "top_logprobs": [entry(tlp, t) for tlp, t, _ in row[:top]] if top else [],
            }
            for (lp, token, _), row in zip(meta["output_token_logprobs"], tops, strict=True)
        ]
    }


def completion_logprobs(
    answer: dict[str, Any], top: int, text_of: Any, echo_from: int | None
) -> dict[str, Any]:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs (a dict of
    text -> logprob per token) and text_offset; with echo, the prompt's tokens first."""
    meta = answer["meta_info"]
    rows = [(lp, t) for lp, t, _ in meta["output_token_logprobs"]]
    tops = meta.get("output_top_logprobs") or [[] for _ in rows]
    if echo_from is not None:
        rows = [(lp, t) for lp, t, _ in meta.get("input_token_logprobs", [])] + rows
        tops = (meta.get("input_top_logprobs") or [[] for _ in range(len(rows) - len(tops))]) + tops
    texts = [text_of(t) for _, t in rows]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [lp for lp, _ in rows],
        "top_logprobs": [
            {text_of(t): tlp for tlp, t, _ in row[:top]} if top else None for row in tops
        ],
        "text_offset": offsets,
    }


def completion_choice(
    request: OpenAIRequest, choice: Choice, text_of: Any, prompt_text: str | None
) -> dict[str, Any]:
    answer = choice.answer
    text = answer["text"]
    if request.echo and prompt_text is not None:
        text = prompt_text + text
    logprobs = None
    if request.logprobs:
        echo_from = 0 if request.echo else None
        logprobs = completion_logprobs(answer, request.top_logprobs, text_of, echo_from)
    out = {
        "index": choice.index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": finish(answer),
        "matched_stop": matched_stop(answer),
    }
    _extras(request, out, choice)
    return out


def chat_choice(request: OpenAIRequest, choice: Choice, text_of: Any) -> dict[str, Any]:
    answer = choice.answer
    out = {
        "index": choice.index,
        "message": {"role": "assistant", "content": answer["text"]},
        "logprobs": chat_logprobs(answer, request.top_logprobs, text_of)
        if request.logprobs
        else None,
        "finish_reason": finish(answer),
        "matched_stop": matched_stop(answer),
    }
    _extras(request, out, choice)
    return out


def envelope(kind: str, rid: str, model: str) -> dict[str, Any]:
    """The fields every response and chunk starts with."""
    prefix = "chatcmpl" if kind.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{rid}", "object": kind, "created": int(time.time()), "model": model}


# -- one-choice answers (the agent gateway's calls: one prompt, n = 1) --------------------------


def completion_response(
    request: OpenAIRequest, model: str, prompt: list[int], answer: dict[str, Any], text_of: Any
) -> dict[str, Any]:
    choice = Choice(0, prompt, answer)
    prompt_text = (
        request.prompts[0] if request.prompts and isinstance(request.prompts[0], str) else None
    )
    return {
        **envelope("text_completion", answer["meta_info"]["id"], model),
        "choices": [completion_choice(request, choice, text_of, prompt_text)],
        "usage": usage([prompt], [choice], int(answer["meta_info"].get("cached_tokens", 0))),
    }


def chat_response(
    request: OpenAIRequest, model: str, prompt: list[int], answer: dict[str, Any], text_of: Any
) -> dict[str, Any]:
    choice = Choice(0, prompt, answer)
    return {
        **envelope("chat.completion", answer["meta_info"]["id"], model),
        "choices": [chat_choice(request, choice, text_of)],
        "usage": usage([prompt], [choice], int(answer["meta_info"].get("cached_tokens", 0))),
    }


# -- errors ------------------------------------------------------------------------------------

# SGLang's ErrorResponse `type` for the statuses its OpenAI handlers answer; other statuses get
# their HTTP reason phrase as a class-like name ("ServiceUnavailableError").
_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_type(status: int) -> str:
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    return "".join(word.capitalize() for word in phrase.replace("-", " ").split()) + "Error"


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """SGLang's ErrorResponse of its OpenAI endpoints (object, message, type, param, code: the
    HTTP status), with the same fields under "error" as well: the shape OpenAI's own API answers,
    which its clients (and Miles' own) read first."""
    fields = {"message": message, "type": error_type(status), "param": param, "code": status}
    return {"object": "error", **fields, "error": dict(fields)}


def responses_error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """SGLang's /v1/responses error: OpenAI's nested error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
