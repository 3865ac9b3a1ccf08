"""What every route of `miles serve` shares: its settings and state, reading a request body, running
one prompt through the engine host, and the /generate answer (whole or streamed)."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from miles.core.contracts.types import SamplingParams
from miles.serve.host import EngineHost, Finished, NotServing, OnTokens
from miles.serve.structured import compile_constraint
from miles.serve.weight_lane import WeightLane
from miles.serve.weights import UpdateGroup
from miles.sglang import openai
from miles.sglang import protocol as wire
from miles.sglang.protocol import BadRequest, GenerateItem

# The SGLang release whose protocol this server follows (what /get_server_info reports).
SGLANG_PROTOCOL = "0.5"
GREEDY_BELOW = 1e-6  # SGLang: a temperature below this samples greedily


@dataclass
class ServeSettings:
    model_path: str
    max_batch_size: int = 64
    max_queue: int = 1024
    # 'Authorization: Bearer KEY' on every endpoint but /health (None: none required; `miles
    # serve` always sets one, see serve_keys).
    api_key: str | None = None
    # Generation and information endpoints need no key (a server on loopback whose key the
    # server made itself, as SGLang's are open there); control and weight endpoints always do.
    open_generation: bool = False
    # The address the server is bound to: requests whose Host names another are refused (DNS
    # rebinding). None: not checked.
    host: str | None = None
    # Browser origins allowed to call it; a request with any other Origin is refused.
    allowed_origins: tuple[str, ...] = ()
    max_body_mb: float = 64.0  # a larger body is refused (413)
    # Deadline of each weight operation (group set-up, weight loads, memory release): past it the
    # request answers 504 naming what it waited for (weight_lane.py).
    weight_timeout_s: float = 300.0
    max_context: int | None = None  # None: the model config's max_position_embeddings
    record_routing: bool = False  # the engine records MoE routes (return_routed_experts)


@dataclass
class ServeState:
    engine: Any
    host: EngineHost
    settings: ServeSettings
    tokenizer: Any
    max_context: int
    lane: WeightLane
    eos_ids: tuple[int, ...] = ()  # what ends a response (structured output allows it at the end)
    model_path: str = ""  # what /get_model_info reports: the last weights loaded from disk
    version_label: str = "default"
    groups: dict[str, UpdateGroup] = field(default_factory=dict)
    released: bool = False
    started: float = field(default_factory=time.time)


def new_rid() -> str:
    return secrets.token_hex(8)


def error(status: int, message: str, path: str = "", param: str | None = None) -> JSONResponse:
    """The error answer of an endpoint at `path`, in the shape SGLang answers there: OpenAI's
    (`openai.error_body`: object, message, type, param, code) under /v1, the Responses API's
    nested object on /v1/responses, and its native `{"error": {"message"}}` elsewhere."""
    if path == "/v1/responses" or path.startswith("/v1/responses/"):
        body = openai.responses_error_body(message, status, param)
    elif path.startswith("/v1/"):
        body = openai.error_body(message, status, param)
    else:
        body = wire.error_body(message)
    return JSONResponse(body, status_code=status)


def ok(message: str) -> JSONResponse:
    return JSONResponse({"success": True, "message": message})


def fail(message: str, status: int = 400) -> JSONResponse:
    """SGLang's answer to a failed control call, with its error object beside it."""
    body = {"success": False, "message": message, **wire.error_body(message)}
    return JSONResponse(body, status_code=status)


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"malformed JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None


async def read_body(request: Request) -> Any:
    limit = request.app.state.miles.settings.max_body_mb * 2**20
    chunks, size = [], 0
    async for chunk in request.stream():  # a body without Content-Length is capped here
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body over {limit / 2**20:g} MB")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


class BodyTooLarge(BadRequest):
    """A request body over `max_body_mb` (413)."""


def check_serving(state: ServeState) -> None:
    if state.released:
        raise NotServing("memory is released: POST /resume_memory_occupation first")


def prompt_ids(state: ServeState, item: GenerateItem) -> list[int]:
    ids = item.input_ids
    if ids is None:
        ids = list(state.tokenizer(item.text)["input_ids"])
    vocab = vocab_size(state)
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise BadRequest(f"request {item.rid}: input_ids must be in [0, {vocab})")
    logit_bias(state, item.sampling)  # refused before anything streams
    check_context(state, len(ids), item.sampling.max_new_tokens)
    return ids


def check_context(state: ServeState, prompt_tokens: int, max_new_tokens: int | None) -> None:
    """SGLang's two refusals, in its words (clients match on them)."""
    context = state.max_context
    if prompt_tokens >= context:
        raise BadRequest(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length "
            f"({context} tokens)."
        )
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > context:
        raise BadRequest(
            f"Requested token count exceeds the model's maximum context length of {context} "
            f"tokens. You requested a total of {prompt_tokens + max_new_tokens} tokens: "
            f"{prompt_tokens} tokens from the input messages and {max_new_tokens} tokens for "
            "the completion. Please reduce the number of tokens in the input messages or the "
            "completion to fit within the limit."
        )


def token_budget(state: ServeState, item: GenerateItem, prompt_tokens: int) -> int:
    """max_new_tokens, or what the context leaves after the prompt when it is not given."""
    given = item.sampling.max_new_tokens
    return state.max_context - prompt_tokens if given is None else given


def submit(
    state: ServeState, item: GenerateItem, prompt_ids: list[int], on_tokens: OnTokens | None = None
) -> asyncio.Future[Finished]:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Finished] = loop.create_future()

    def settle(finished: Finished) -> None:
        if not future.done():  # the client may have gone
            future.set_result(finished)

    def deliver(finished: Finished) -> None:
        loop.call_soon_threadsafe(settle, finished)

    sampling = engine_sampling(state, item, len(prompt_ids))
    state.host.submit(item.rid, prompt_ids, sampling, deliver, on_tokens, item.cache_salt)
    return future


def engine_sampling(state: ServeState, item: GenerateItem, prompt_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for one prompt: a fresh grammar state of its own."""
    s = item.sampling
    try:
        grammar = compile_constraint(
            state.tokenizer,
            response_format=s.response_format,
            json_schema=s.json_schema,
            regex=s.regex,
            ebnf=s.ebnf,
            eos_token_ids=state.eos_ids or None,
        )
    except ValueError as exc:
        raise BadRequest(f"request {item.rid}: {exc}") from None
    return SamplingParams(
        temperature=0.0 if s.temperature < GREEDY_BELOW else s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_new_tokens=token_budget(state, item, prompt_tokens),
        stop_token_ids=s.stop_token_ids,
        stop_strings=s.stop,
        seed=s.seed,
        ignore_eos=s.ignore_eos,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty,
        stop_regex=s.stop_regex,
        logit_bias=logit_bias(state, s),
        # As SGLang: logprob fields count only with return_logprob (a prompt's logprobs would
        # also keep it from the prefix cache).
        top_logprobs=item.top_logprobs_num if item.return_logprob else 0,
        prompt_logprobs=item.return_logprob and item.logprob_start_len >= 0,
        constraint=grammar() if grammar is not None else None,
    )


def logit_bias(state: ServeState, s: wire.Sampling) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as the engine's (token, bias) pairs, its ids checked against the
    vocabulary in SGLang's words."""
    vocab = vocab_size(state)
    for token in s.logit_bias:
        if vocab and not 0 <= token < vocab:
            raise BadRequest(f"logit_bias must has keys in [0, {vocab - 1}], got {token}.")
    return tuple(sorted(s.logit_bias.items()))


def vocab_size(state: ServeState) -> int:
    """The model's vocabulary size (0: unknown)."""
    return int(getattr(state.engine.model.config, "vocab_size", 0) or 0)


def refuse_rejected(*finished: Finished) -> None:
    """A 400 (SGLang's answer) if the engine refused one of these requests (its argument checks:
    they name the request), instead of a 200 with finish_reason abort; a failure of the engine
    itself stays the abort answer, with its message. For whole answers only: a stream has
    already sent its 200."""
    for done in finished:
        if done.error is not None and done.error.startswith("request "):
            raise BadRequest(f"the engine refused the request ({done.error})")


async def generate_one(state: ServeState, item: GenerateItem) -> tuple[list[int], dict[str, Any]]:
    """One prompt through the engine: its token ids and its /generate answer."""
    check_serving(state)
    ids = prompt_ids(state, item)
    done = await submit(state, item, ids)
    refuse_rejected(done)
    return ids, answer(state, item, done)


def chat_prompt(state: ServeState, body: dict[str, Any]) -> list[int]:
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise BadRequest(
            "/v1/chat/completions: this model's tokenizer has no chat template; send the "
            "prompt's token ids as input_ids"
        )
    messages = body["messages"]
    # SGLang's continue_final_message: a last assistant message is continued, not closed (no new
    # assistant turn is opened after it); with any other last message it changes nothing.
    go_on = bool(body.get("continue_final_message")) and messages[-1].get("role") == "assistant"
    try:
        ids = tok.apply_chat_template(
            messages,
            tools=body.get("tools"),
            add_generation_prompt=not go_on,
            continue_final_message=go_on,
            tokenize=True,
            **(body.get("chat_template_kwargs") or {}),
        )
    except ValueError as exc:  # e.g. a template that does not render the final message as given
        raise BadRequest(f"/v1/chat/completions: the chat template failed: {exc}") from None
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def token_texts(state: ServeState, answer: dict[str, Any]) -> list[str]:
    return [state.tokenizer.decode([t]) for t in answer["output_ids"]]


def model_name(body: dict[str, Any], settings: ServeSettings) -> str:
    return str(body.get("model") or settings.model_path)


def decode_text(state: ServeState, item: GenerateItem, ids: list[int]) -> str:
    """A response's text as the request asked it decoded (special tokens kept or skipped)."""
    s = item.sampling
    return str(
        state.tokenizer.decode(
            ids,
            skip_special_tokens=s.skip_special_tokens,
            spaces_between_special_tokens=s.spaces_between_special_tokens,
        )
    )


def answer(state: ServeState, item: GenerateItem, done: Finished) -> dict[str, Any]:
    """SGLang's /generate response object for one finished prompt."""
    s = item.sampling
    text = decode_text(state, item, done.response_ids)
    matched: int | str | None = None
    if done.finish_reason == "stop":
        matched, cut = matched_stop(s, text, done.response_ids)
        if cut is not None and not s.no_stop_trim:  # SGLang cuts a matched stop from the text
            text = text[:cut]
    budget = len(done.response_ids) if s.max_new_tokens is None else s.max_new_tokens
    meta: dict[str, Any] = {
        "id": done.rid,
        "finish_reason": wire.finish_reason(done.finish_reason, matched, budget),
        "prompt_tokens": len(done.prompt_ids),
        "completion_tokens": len(done.response_ids),
        "cached_tokens": done.cached_tokens,
        "weight_version": state.version_label,
        "e2e_latency": time.perf_counter() - done.started,
    }
    if done.error is not None:
        meta["finish_reason"]["message"] = f"the engine failed: {done.error}"

    def decode(token: int) -> str | None:
        return state.tokenizer.decode([token]) if item.return_text_in_logprobs else None

    if item.return_logprob:
        meta["output_token_logprobs"] = [
            [float(lp), int(t), decode(t)]
            for lp, t in zip(done.logprobs, done.response_ids, strict=True)
        ]
    if item.return_logprob and item.top_logprobs_num:
        meta["output_top_logprobs"] = [
            [[float(lp), int(t), decode(t)] for t, lp in row] for row in done.top_logprobs or []
        ]
    if item.return_logprob and item.logprob_start_len >= 0:
        add_prompt_logprobs(meta, item, done, decode)
    if item.return_routed_experts and done.routing is not None:
        rows = len(done.prompt_ids) + len(done.response_ids) - 1
        routes = np.ascontiguousarray(np.asarray(done.routing)[:rows], dtype=np.int32)
        meta["routed_experts"] = wire.encode_routed_experts(routes.tobytes())
    return {"text": text, "output_ids": list(done.response_ids), "meta_info": meta}


def matched_stop(
    s: wire.Sampling, text: str, response_ids: list[int]
) -> tuple[int | str | None, int | None]:
    """What ended a stopped response (a stop token id, a stop string, the stop_regex pattern that
    matched, or the EOS id) and where the text is cut (None: not cut).

    As SGLang: a stop_regex's `matched` is the pattern itself (FINISHED_MATCHED_REGEX), and its
    text is cut the way SGLang cuts any string `matched`, at the first occurrence of that string
    in the text; a pattern that does not occur literally (most do not) leaves the text whole,
    the matched text included."""
    last = response_ids[-1] if response_ids else None
    if last is not None and last in s.stop_token_ids:
        return last, None
    found: list[tuple[int, str, int | None]] = []  # (where it matched, matched, the cut)
    for stop in s.stop:
        if (at := text.find(stop)) >= 0:
            found.append((at, stop, at))
    for pattern in s.stop_regex:
        if (m := re.search(pattern, text)) is not None:
            at = text.find(pattern)
            found.append((m.start(), pattern, at if at >= 0 else None))
    if found:
        _, hit, cut = min(found, key=lambda f: f[0])
        return hit, cut
    return last, None


def add_prompt_logprobs(
    meta: dict[str, Any], item: GenerateItem, done: Finished, decode: Callable[[int], str | None]
) -> None:
    """SGLang's input_token_logprobs (and input_top_logprobs) from logprob_start_len: the first
    prompt token has no logprob (null)."""
    lps: list[float | None] = [None, *(done.prompt_logprobs or [])]
    tops: list[list[tuple[int, float]]] = [[], *(done.prompt_top_logprobs or [])]
    start = min(item.logprob_start_len, len(done.prompt_ids))
    meta["input_token_logprobs"] = [
        [lps[i] if i < len(lps) else None, int(done.prompt_ids[i]), decode(done.prompt_ids[i])]
        for i in range(start, len(done.prompt_ids))
    ]
    if item.top_logprobs_num:
        meta["input_top_logprobs"] = [
            [[float(lp), int(t), decode(t)] for t, lp in tops[i]] if i < len(tops) else []
            for i in range(start, len(done.prompt_ids))
        ]


class Progress:
    """A streamed prompt's latest tokens, handed from the engine's thread to the event loop.
    Only the newest state is kept: a slow client gets fewer, fuller chunks. With top logprobs
    (prompt logprobs) asked, `top_logprobs` (`prompt_logprobs`, `prompt_top_logprobs`) come
    too, as in `Finished`; else None."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.changed = asyncio.Event()
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] | None = None
        self.prompt_logprobs: list[float] | None = None
        self.prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    def update(
        self, ids: list[int], logprobs: list[float], extras: Mapping[str, Any] | None = None
    ) -> None:  # on the engine's thread
        extras = extras or {}
        top, prompt, prompt_top = (
            extras.get(k) for k in ("top_logprobs", "prompt_logprobs", "prompt_top_logprobs")
        )
        # One consistent length: another engine call's step may be appending meanwhile.
        n = min(len(ids), len(logprobs), len(top) if top is not None else len(ids))
        snapshot = (
            ids[:n],
            logprobs[:n],
            None if top is None else top[:n],
            None if prompt is None else list(prompt),
            None if prompt_top is None else list(prompt_top),
        )
        self._loop.call_soon_threadsafe(self._set, snapshot)

    def _set(self, snapshot: tuple[Any, ...]) -> None:
        (
            self.ids,
            self.logprobs,
            self.top_logprobs,
            self.prompt_logprobs,
            self.prompt_top_logprobs,
        ) = snapshot
        self.changed.set()


async def stream_answer(
    state: ServeState,
    item: GenerateItem,
    prompt_tokens: int,
    wait: asyncio.Future[Finished],
    progress: Progress,
) -> AsyncIterator[bytes]:
    """Server-sent events as SGLang sends them by default: each chunk holds the whole answer so
    far (text, output_ids, output_token_logprobs) with finish_reason null, the last one the
    finished answer; then `[DONE]`."""
    while not wait.done():
        changed = asyncio.ensure_future(progress.changed.wait())
        either: list[asyncio.Future[Any]] = [wait, changed]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        changed.cancel()
        if progress.changed.is_set() and not wait.done():
            progress.changed.clear()
            chunk = partial_answer(state, item, prompt_tokens, progress.ids, progress.logprobs)
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield f"data: {json.dumps(answer(state, item, wait.result()))}\n\n".encode()
    yield b"data: [DONE]\n\n"


def partial_answer(
    state: ServeState, item: GenerateItem, prompt_tokens: int, ids: list[int], logprobs: list[float]
) -> dict[str, Any]:
    """A streamed chunk before the end: the answer so far, finish_reason null."""
    tok = state.tokenizer
    meta: dict[str, Any] = {
        "id": item.rid,
        "finish_reason": None,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "weight_version": state.version_label,
    }
    if item.return_logprob:
        meta["output_token_logprobs"] = [
            [float(lp), int(t), tok.decode([t]) if item.return_text_in_logprobs else None]
            for lp, t in zip(logprobs, ids, strict=True)
        ]
    return {"text": decode_text(state, item, ids), "output_ids": list(ids), "meta_info": meta}
