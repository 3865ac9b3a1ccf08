"""OpenAI-compatible completions and chat completions, with SGLang's RL extensions, translated to
and from the engine's terms. The routes live in `server.py`; this module holds the wire format.

Extensions (SGLang's): `return_token_ids` (a choice's `token_ids`, and `prompt_token_ids`),
`return_prompt_token_ids`, `return_meta_info` (the /generate `meta_info` on each choice, with
`output_token_logprobs`), and for chat `input_ids`, a prompt already tokenized (so an agent's turns
train on exactly the tokens the model saw). Only `n: 1` and no streaming.
"""

from __future__ import annotations

import time
from typing import Any

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
    "seed": (int, None),
    "stream": (bool, None),
    "user": (str, None),
    "return_token_ids": (bool,),
    "return_prompt_token_ids": (bool,),
    "return_meta_info": (bool,),
    "skip_special_tokens": (bool,),
    "rid": (str, None),
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
}
# OpenAI fields a client may send at their defaults.
_UNSUPPORTED = ("frequency_penalty", "presence_penalty", "logit_bias", "best_of", "suffix",
                "response_format", "stream_options", "parallel_tool_calls")  # fmt: skip
COMPLETION_RESPONSE_FIELDS = ("id", "object", "created", "model", "choices", "usage")
COMPLETION_CHOICE_FIELDS = ("index", "text", "logprobs", "finish_reason")
CHAT_CHOICE_FIELDS = ("index", "message", "logprobs", "finish_reason")
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "total_tokens")


def sampling_of(body: dict[str, Any], where: str) -> Sampling:
    if body.get("n") not in (None, 1):
        raise BadRequest(f"{where}: n must be 1 (send one request per sample)")
    if body.get("stream"):
        raise BadRequest(f"{where}: streaming is not supported by miles serve's OpenAI API")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    max_tokens = 16 if max_tokens is None else max_tokens
    if max_tokens < 0:
        raise BadRequest(f"{where}: max_tokens must be >= 0, got {max_tokens}")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"{where}: stop must be a non-empty string or a list of them")
    ids = body.get("stop_token_ids") or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest(f"{where}: stop_token_ids must be a list of integers")
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else float(temperature)
    top_p = 1.0 if body.get("top_p") is None else float(body["top_p"])
    if temperature < 0 or not 0 < top_p <= 1:
        raise BadRequest(f"{where}: temperature must be >= 0 and top_p in (0, 1]")
    return Sampling(
        max_new_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=-1 if body.get("top_k") is None else body["top_k"],
        min_p=0.0 if body.get("min_p") is None else float(body["min_p"]),
        stop=stops,
        stop_token_ids=tuple(ids),
        skip_special_tokens=body.get("skip_special_tokens", True),
        seed=body.get("seed"),
    )


def parse_completion(body: Any) -> tuple[dict[str, Any], Sampling, list[int] | str]:
    b = check_fields(body, COMPLETION_FIELDS, "/v1/completions", _UNSUPPORTED, ("prompt",))
    prompt = b["prompt"]
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise BadRequest("/v1/completions: prompt must be a string or token ids (one prompt)")
    if not prompt:
        raise BadRequest("/v1/completions: an empty prompt")
    if b.get("echo"):
        raise BadRequest("/v1/completions: echo is not supported by miles serve")
    return b, sampling_of(b, "/v1/completions"), prompt


def parse_chat(body: Any) -> tuple[dict[str, Any], Sampling]:
    b = check_fields(body, CHAT_FIELDS, "/v1/chat/completions", _UNSUPPORTED, ("messages",))
    for i, message in enumerate(b["messages"]):
        if not isinstance(message, dict) or "role" not in message:
            raise BadRequest(f"/v1/chat/completions: messages[{i}] needs a 'role'")
    ids = b.get("input_ids")
    if ids is not None and not (
        ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
    ):
        raise BadRequest("/v1/chat/completions: input_ids must be a non-empty list of integers")
    return b, sampling_of(b, "/v1/chat/completions")


def _extras(
    body: dict[str, Any], choice: dict[str, Any], answer: dict[str, Any], prompt: list[int]
) -> None:
    if body.get("return_token_ids"):
        choice["token_ids"] = answer["output_ids"]
        choice["prompt_token_ids"] = prompt
    if body.get("return_prompt_token_ids"):
        choice["prompt_token_ids"] = prompt
    if body.get("return_meta_info"):
        choice["meta_info"] = answer["meta_info"]


def _finish(answer: dict[str, Any]) -> str:
    kind = str(answer["meta_info"]["finish_reason"]["type"])
    return kind if kind in ("stop", "length") else "abort"


def _usage(prompt: list[int], answer: dict[str, Any]) -> dict[str, int]:
    completion = len(answer["output_ids"])
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": completion,
        "total_tokens": len(prompt) + completion,
    }


def completion_response(
    body: dict[str, Any], model: str, prompt: list[int], answer: dict[str, Any], tokens: list[str]
) -> dict[str, Any]:
    """`answer`: the /generate response (with logprobs); `tokens`: each output token's text."""
    logprobs = None
    if body.get("logprobs") is not None:
        entries = answer["meta_info"]["output_token_logprobs"]
        logprobs = {
            "tokens": tokens,
            "token_logprobs": [e[0] for e in entries],
            "top_logprobs": None,
            "text_offset": None,
        }
    choice = {
        "index": 0,
        "text": answer["text"],
        "logprobs": logprobs,
        "finish_reason": _finish(answer),
    }
    _extras(body, choice, answer, prompt)
    return {
        "id": f"cmpl-{answer['meta_info']['id']}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt, answer),
    }


def chat_response(
    body: dict[str, Any], model: str, prompt: list[int], answer: dict[str, Any], tokens: list[str]
) -> dict[str, Any]:
    logprobs = None
    if body.get("logprobs"):
        entries = answer["meta_info"]["output_token_logprobs"]
        logprobs = {
            "content": [
                {"token": t, "logprob": e[0], "bytes": list(t.encode()), "top_logprobs": []}
                for t, e in zip(tokens, entries, strict=True)
            ]
        }
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": answer["text"]},
        "logprobs": logprobs,
        "finish_reason": _finish(answer),
    }
    _extras(body, choice, answer, prompt)
    return {
        "id": f"chatcmpl-{answer['meta_info']['id']}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(prompt, answer),
    }
