"""SGLang's wire protocol: the request and response fields, written from SGLang's `io_struct.py`
(`GenerateReqInput`), `sampling_params.py` and `http_server.py` (0.5.x), and the checks a server
of ours applies to a request body. Pure Python: the client and `miles serve` share it.

Three kinds of request field:
- supported: parsed, type-checked, honoured;
- SGLang's, not supported here: accepted only at SGLang's default (null, false, 0), else a 400
  that names the field (so a client written for SGLang gets a clear answer, not a silent change);
- anything else: a 400 naming the unknown field (drift on either side fails loudly).
"""

from __future__ import annotations

import base64
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

# -- /generate request -------------------------------------------------------------------------

# name -> JSON types accepted (None: null). `input_ids` and `text` may also be batches (lists).
GENERATE_FIELDS: dict[str, tuple[type | None, ...]] = {
    "text": (str, list),
    "input_ids": (list,),
    "sampling_params": (dict, list, None),
    "rid": (str, list, None),
    "return_logprob": (bool, list, None),
    "logprob_start_len": (int, list, None),
    "top_logprobs_num": (int, list, None),
    "return_text_in_logprobs": (bool,),
    "stream": (bool,),
    "return_routed_experts": (bool,),
    "log_metrics": (bool,),
    "cache_salt": (str, list, None),
}
# SGLang GenerateReqInput fields this server does not implement (accepted at their default).
GENERATE_UNSUPPORTED: tuple[str, ...] = (
    "session_id", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "token_ids_logprob",
    "return_sampling_mask", "return_flat_raw_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_hidden_states", "routed_experts_start_len", "return_indexer_topk", "modalities",
    "session_params", "lora_path", "lora_id", "custom_logit_processor",
    "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank",
    "disagg_prefill_dp_rank", "kv_router_hint", "routing_key", "conversation_id",
    "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens", "priority",
    "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy",
    "return_prompt_token_ids", "external_trace_header", "received_time",
)  # fmt: skip

SAMPLING_FIELDS: dict[str, tuple[type | None, ...]] = {
    "max_new_tokens": (int, None),
    "temperature": (float, int),
    "top_p": (float, int),
    "top_k": (int,),
    "min_p": (float, int),
    "stop": (str, list, None),
    "stop_token_ids": (list, None),
    "skip_special_tokens": (bool,),
    "spaces_between_special_tokens": (bool,),
    "no_stop_trim": (bool,),
    "ignore_eos": (bool,),
    "n": (int,),
    "sampling_seed": (int, None),
    "frequency_penalty": (float, int),
    "presence_penalty": (float, int),
    "repetition_penalty": (float, int),
    "stop_regex": (str, list, None),
    "json_schema": (str, None),
    "regex": (str, None),
    "ebnf": (str, None),
    "logit_bias": (dict, None),
}
SAMPLING_UNSUPPORTED: tuple[str, ...] = (
    "min_new_tokens", "structural_tag", "custom_params", "stream_interval", "dtype",
)  # fmt: skip
MAX_N = 64  # samples of one prompt in one request
MAX_TOP_LOGPROBS = 20
# A logit_bias beyond this is refused: SGLang sets no bound, but a bias this large already decides
# every draw, and a larger one could overflow float32 logits (OpenAI documents [-100, 100]).
MAX_LOGIT_BIAS = 1e6
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 128,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "ignore_eos": False,
    "n": 1,
    "sampling_seed": None,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "logit_bias": None,
}

# -- /generate response ------------------------------------------------------------------------

RESPONSE_FIELDS = ("text", "output_ids", "meta_info")
META_INFO_FIELDS = (
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_version",
    "e2e_latency",
)
META_INFO_LOGPROB_FIELDS = ("output_token_logprobs",)  # with return_logprob
META_INFO_ROUTING_FIELDS = ("routed_experts",)  # with return_routed_experts
FINISH_TYPES = ("stop", "length", "abort")


class BadRequest(ValueError):
    """A request the protocol refuses: the server answers 400 with this message. `param`: the
    request field at fault, for the OpenAI error object's `param` (None: not named)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NotFound(BadRequest):
    """A request for something the server does not have (404)."""


def check_fields(
    body: Any,
    fields: dict[str, tuple[type | None, ...]],
    what: str,
    unsupported: tuple[str, ...] = (),
    required: tuple[str, ...] = (),
) -> dict[str, Any]:
    """`body` as a dict whose every key is a known field of the right JSON type; a field SGLang
    has and this server does not is allowed only at a falsy default."""
    if not isinstance(body, dict):
        raise BadRequest(f"{what}: the body must be a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in unsupported:
            if value not in (None, False, 0, [], {}, ""):
                raise BadRequest(
                    f"{what}: {key!r} is an SGLang field that miles serve does not support"
                )
            continue
        if key not in fields:
            known = ", ".join(sorted(fields))
            raise BadRequest(f"{what}: unknown field {key!r} (fields: {known})")
        if not _is_json_type(value, fields[key]):
            names = "/".join("null" if t is None else _JSON_NAMES[t] for t in fields[key])
            raise BadRequest(f"{what}: {key!r} must be {names}, got {_json_name(value)}")
    missing = [k for k in required if body.get(k) is None]
    if missing:
        raise BadRequest(f"{what}: missing {', '.join(repr(k) for k in missing)}")
    return {k: v for k, v in body.items() if k in fields}


_JSON_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array",
               dict: "object"}  # fmt: skip


def _json_name(value: Any) -> str:
    return "null" if value is None else _JSON_NAMES.get(type(value), type(value).__name__)


def _is_json_type(value: Any, types: tuple[type | None, ...]) -> bool:
    if value is None:
        return None in types
    if isinstance(value, bool):  # bool is an int in Python, not in JSON
        return bool in types
    return any(t is not None and isinstance(value, t) for t in types)


# -- a parsed /generate ------------------------------------------------------------------------


@dataclass
class Sampling:
    """One request's sampling_params, checked."""

    max_new_tokens: int | None = 128  # None: up to the context length (OpenAI's default)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_regex: tuple[str, ...] = ()
    # Structured output, at most one (structured.py compiles it): SGLang's names, and OpenAI's
    # response_format object.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    response_format: dict[str, Any] | None = None
    # logit_bias: token id -> bias added to its logit (keys checked against the vocabulary by the
    # server, which knows it).
    logit_bias: dict[int, float] = field(default_factory=dict)


@dataclass
class GenerateItem:
    """One prompt of a /generate call (a batch call has several)."""

    rid: str
    sampling: Sampling
    input_ids: list[int] | None = None
    text: str | None = None
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # >= 0: the prompt's logprobs from this position on
    cache_salt: str | None = None  # shares cached prefixes only with requests of the same salt


@dataclass
class GenerateCall:
    items: list[GenerateItem]
    batch: bool  # the body held lists: the response is a JSON array
    stream: bool = False


def parse_sampling(params: Any, where: str) -> Sampling:
    p = check_fields(params or {}, SAMPLING_FIELDS, where, SAMPLING_UNSUPPORTED)
    p = {**SAMPLING_DEFAULTS, **{k: v for k, v in p.items() if v is not None}}
    if p["max_new_tokens"] < 0:
        raise BadRequest(f"{where}: max_new_tokens must be >= 0, got {p['max_new_tokens']}")
    for name in ("temperature", "top_p", "min_p"):  # NaN passes every comparison below
        if not math.isfinite(p[name]):
            raise BadRequest(f"{where}: {name} must be a finite number, got {p[name]}")
    if p["temperature"] < 0:
        raise BadRequest(f"{where}: temperature must be >= 0, got {p['temperature']}")
    if not 0 < p["top_p"] <= 1:
        raise BadRequest(f"{where}: top_p must be in (0, 1], got {p['top_p']}")
    if p["top_k"] == 0 or p["top_k"] < -1:
        raise BadRequest(f"{where}: top_k must be -1 (off) or >= 1, got {p['top_k']}")
    if not 0 <= p["min_p"] <= 1:
        raise BadRequest(f"{where}: min_p must be in [0, 1], got {p['min_p']}")
    check_n(p["n"], where)
    penalties = check_penalties(p, where)
    seed = p["sampling_seed"]
    if seed is not None and not 0 <= seed < 2**63:
        raise BadRequest(f"{where}: sampling_seed must be in [0, 2**63), got {seed}")
    stop = p["stop"]
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise BadRequest(f"{where}: stop must be a non-empty string or a list of them")
    ids = p["stop_token_ids"] or []
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest(f"{where}: stop_token_ids must be a list of integers")
    return Sampling(
        max_new_tokens=p["max_new_tokens"],
        # SGLang: a temperature below 1e-6 is greedy.
        temperature=float(p["temperature"]),
        top_p=float(p["top_p"]),
        top_k=p["top_k"],
        min_p=float(p["min_p"]),
        stop=stops,
        stop_token_ids=tuple(ids),
        skip_special_tokens=p["skip_special_tokens"],
        spaces_between_special_tokens=p["spaces_between_special_tokens"],
        no_stop_trim=p["no_stop_trim"],
        seed=seed,
        n=p["n"],
        ignore_eos=p["ignore_eos"],
        **penalties,
        stop_regex=check_stop_regex(p["stop_regex"], where),
        json_schema=p["json_schema"],
        regex=p["regex"],
        ebnf=p["ebnf"],
        logit_bias=check_logit_bias(p["logit_bias"], where),
    )


def check_logit_bias(value: Any, where: str) -> dict[int, float]:
    """SGLang's logit_bias ({"token id": bias}, the ids as JSON object keys, so strings) as
    {id: bias}; the ids' upper bound is the server's to check (the vocabulary)."""
    out: dict[int, float] = {}
    for key, bias in (value or {}).items():
        token = str(key).strip()
        if not token.lstrip("-").isdigit():
            raise BadRequest(f"{where}: logit_bias keys must be token ids, got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise BadRequest(f"{where}: logit_bias[{key!r}] must be a number, got {bias!r}")
        if not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
            raise BadRequest(
                f"{where}: logit_bias[{key!r}] must be in [-{MAX_LOGIT_BIAS:g}, "
                f"{MAX_LOGIT_BIAS:g}], got {bias}"
            )
        out[int(token)] = float(bias)
    return out


def check_cache_salt(value: Any, where: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}: cache_salt must be a non-empty string, got {value!r}")
    return value


def nth_sample(sampling: Sampling, j: int) -> Sampling:
    """The j-th of n samples of one prompt: with a seed, seed + j, so the n samples differ but the
    request stays reproducible."""
    if sampling.seed is None or j == 0:
        return sampling
    return replace(sampling, seed=(sampling.seed + j) % 2**63)


def check_n(n: int, where: str) -> None:
    if not 1 <= n <= MAX_N:
        raise BadRequest(f"{where}: n must be in [1, {MAX_N}], got {n}")


def check_penalties(p: dict[str, Any], where: str) -> dict[str, Any]:
    """frequency/presence penalties in [-2, 2] (OpenAI's range), repetition_penalty in (0, 2]."""
    out = {}
    for name, low, high, default in (
        ("frequency_penalty", -2.0, 2.0, 0.0),
        ("presence_penalty", -2.0, 2.0, 0.0),
        ("repetition_penalty", 0.0, 2.0, 1.0),
    ):
        value = float(default if p.get(name) is None else p[name])
        if not (math.isfinite(value) and low <= value <= high) or (low == 0.0 and value == 0.0):
            side = "(0" if low == 0.0 else f"[{low:g}"
            raise BadRequest(f"{where}: {name} must be in {side}, {high:g}], got {value}")
        out[name] = value
    return out


def check_stop_regex(value: Any, where: str) -> tuple[str, ...]:
    patterns = (value,) if isinstance(value, str) else tuple(value or ())
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise BadRequest(f"{where}: stop_regex must be a non-empty string or a list of them")
        try:
            re.compile(pattern)
        except re.error as exc:
            message = f"{where}: stop_regex {pattern!r} is not a regular expression: {exc}"
            raise BadRequest(message) from None
    return patterns


def parse_generate(body: Any, new_rid: Any) -> GenerateCall:
    """A /generate body as prompts to run; `new_rid()` names a request that brings no rid."""
    b = check_fields(body, GENERATE_FIELDS, "/generate", GENERATE_UNSUPPORTED)
    text, ids = b.get("text"), b.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("/generate: give exactly one of 'text' and 'input_ids'")
    if ids is not None:
        batch = bool(ids) and isinstance(ids[0], list)
        prompts: list[Any] = ids if batch else [ids]
        for i, prompt in enumerate(prompts):
            if not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt
            ):
                raise BadRequest(f"/generate: input_ids[{i}] must be a non-empty list of integers")
    else:
        batch = isinstance(text, list)
        prompts = list(text) if isinstance(text, list) else [text]
        if not all(isinstance(t, str) and t for t in prompts):
            raise BadRequest("/generate: text must be a non-empty string or a list of them")
    if batch and not prompts:
        raise BadRequest("/generate: an empty batch")
    n = len(prompts)

    def per_item(key: str, default: Any) -> list[Any]:
        value = b.get(key)
        if isinstance(value, list) and key != "stop":
            if len(value) != n:
                raise BadRequest(f"/generate: {key!r} has {len(value)} entries for {n} prompts")
            return [default if v is None else v for v in value]
        return [default if value is None else value] * n

    params = per_item("sampling_params", {})
    logprob = per_item("return_logprob", False)
    rids = per_item("rid", None)
    starts = per_item("logprob_start_len", -1)
    tops = per_item("top_logprobs_num", 0)
    salts = per_item("cache_salt", None)
    for i in range(n):
        if starts[i] < -1:
            raise BadRequest(f"/generate: logprob_start_len must be >= -1, got {starts[i]}")
        if not 0 <= tops[i] <= MAX_TOP_LOGPROBS:
            raise BadRequest(
                f"/generate: top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {tops[i]}"
            )
    if batch and isinstance(b.get("rid"), str):  # SGLang: a prefix for the batch's ids
        rids = [f"{b['rid']}_{i}" for i in range(n)]
    items = [
        GenerateItem(
            rid=str(rids[i]) if rids[i] is not None else str(new_rid()),
            sampling=parse_sampling(params[i], f"/generate sampling_params[{i}]"),
            input_ids=list(prompts[i]) if ids is not None else None,
            text=prompts[i] if text is not None else None,
            return_logprob=bool(logprob[i]),
            return_text_in_logprobs=bool(b.get("return_text_in_logprobs", False)),
            return_routed_experts=bool(b.get("return_routed_experts", False)),
            top_logprobs_num=tops[i],
            logprob_start_len=starts[i],
            cache_salt=check_cache_salt(salts[i], "/generate"),
        )
        for i in range(n)
    ]
    # SGLang's parallel sampling: n answers of each prompt, prompt by prompt, in a JSON array.
    if any(item.sampling.n > 1 for item in items):
        items = [
            replace(item, rid=f"{item.rid}_{j}", sampling=nth_sample(item.sampling, j))
            if item.sampling.n > 1
            else item
            for item in items
            for j in range(item.sampling.n)
        ]
        batch = True
    stream = bool(b.get("stream", False))
    if stream and len(items) > 1:
        raise BadRequest("/generate: stream takes one prompt and n = 1, not a batch")
    return GenerateCall(items=items, batch=batch, stream=stream)


def finish_reason(kind: str, matched: int | str | None, max_new_tokens: int) -> dict[str, Any]:
    """SGLang's finish_reason object."""
    if kind == "stop":
        return {"type": "stop", "matched": matched}
    if kind == "length":
        return {"type": "length", "length": max_new_tokens}
    return {"type": "abort", "message": "aborted", "status_code": 200}


def encode_routed_experts(flat_int32_bytes: bytes) -> str:
    return base64.b64encode(flat_int32_bytes).decode("ascii")


def error_body(message: str) -> dict[str, Any]:
    """SGLang's error object."""
    return {"error": {"message": message}}
