"""`miles serve`'s HTTP application: SGLang's native endpoints over Miles' torch engine.

Starlette/FastAPI routes, each a thin shell: the body is checked against the protocol's field
lists (`protocol.py`: a 400 with SGLang's error object for malformed JSON, unknown fields, wrong
types, bad values), the work goes to the `EngineHost` (generation) or to the engine itself
(weights, memory), blocking calls on worker threads so the event loop keeps serving `/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import version as package_version
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from miles.core.types import SamplingParams
from miles.sglang import openai
from miles.sglang import protocol as wire
from miles.sglang.host import EngineHost, Finished, NotServing, OnTokens, QueueFull
from miles.sglang.protocol import BadRequest, GenerateItem
from miles.sglang.serve_keys import LOOPBACK
from miles.sglang.tensors import PayloadRefused, load_named_tensors
from miles.sglang.weight_lane import DeadlineExceeded, LaneBusy, WeightLane
from miles.sglang.weights import UpdateGroup, check_update, safetensors_weights

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
class _State:
    engine: Any
    host: EngineHost
    settings: ServeSettings
    tokenizer: Any
    max_context: int
    lane: WeightLane
    version_label: str = "default"
    groups: dict[str, UpdateGroup] = field(default_factory=dict)
    released: bool = False
    started: float = field(default_factory=time.time)


def build_app(
    engine: Any, settings: ServeSettings, exit_deadline_s: float | None = None
) -> FastAPI:
    """The ASGI app serving `engine` (a `TorchRolloutEngine`, loaded). `exit_deadline_s`: once
    its shutdown starts, the process exits after this long even if the shutdown hangs (None:
    never forced; for an app embedded in another process)."""
    config = engine.model.config
    max_context = settings.max_context or int(
        getattr(config, "max_position_embeddings", 0) or 1 << 20
    )
    state = _State(
        engine=engine,
        host=EngineHost(engine, settings.max_batch_size, settings.max_queue),
        settings=settings,
        tokenizer=engine.tokenizer,
        max_context=max_context,
        lane=WeightLane(settings.weight_timeout_s),
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if exit_deadline_s is not None:
            _exit_after(exit_deadline_s)
        state.host.close()  # graceful: uvicorn has stopped taking requests and drained them
        for group in state.groups.values():
            group.close()
        print("miles serve: shut down", file=sys.stderr, flush=True)

    app = FastAPI(
        title="miles serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.miles = state

    @app.middleware("http")
    async def guard(request: Request, call_next: Callable[..., Awaitable[Any]]) -> Any:
        if refused := _refusal(request, settings):
            await _discard_body(request, settings)
            return refused
        return await call_next(request)

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, exc: BadRequest) -> JSONResponse:
        return _error(413 if isinstance(exc, BodyTooLarge) else 400, str(exc))

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, not the client's: say what broke, in SGLang's error object.
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.exception_handler(NotServing)
    async def not_serving(_: Request, exc: NotServing) -> JSONResponse:
        return _error(503, str(exc))

    @app.exception_handler(LaneBusy)
    async def lane_busy(_: Request, exc: LaneBusy) -> JSONResponse:
        return _fail(str(exc), 503)

    @app.exception_handler(DeadlineExceeded)
    async def deadline(_: Request, exc: DeadlineExceeded) -> JSONResponse:
        return _fail(str(exc), 504)

    @app.exception_handler(QueueFull)
    async def queue_full(_: Request, exc: QueueFull) -> JSONResponse:
        return _error(503, str(exc))

    # -- generation ----------------------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        call = wire.parse_generate(await _body(request), _new_rid)
        if not settings.record_routing and any(i.return_routed_experts for i in call.items):
            raise BadRequest(
                "return_routed_experts: this server records no routes (start miles serve with "
                "--record-routing, on a MoE model)"
            )
        _check_serving(state)
        prompts = [_prompt_ids(state, item) for item in call.items]
        if call.stream:  # one prompt (the parser refuses a streamed batch)
            item, ids = call.items[0], prompts[0]
            progress = _Progress(asyncio.get_running_loop())
            wait = _submit(state, item, ids, progress.update)
            return StreamingResponse(
                _stream(state, item, len(ids), wait, progress), media_type="text/event-stream"
            )
        waits = [_submit(state, item, ids) for item, ids in zip(call.items, prompts, strict=True)]
        done = await asyncio.gather(*waits)
        answers = [_answer(state, item, f) for item, f in zip(call.items, done, strict=True)]
        return JSONResponse(answers if call.batch else answers[0])

    @app.post("/v1/completions")
    async def completions(request: Request) -> JSONResponse:
        body, sampling, prompt = openai.parse_completion(await _body(request))
        item = GenerateItem(
            rid=body.get("rid") or _new_rid(),
            sampling=sampling,
            input_ids=prompt if isinstance(prompt, list) else None,
            text=prompt if isinstance(prompt, str) else None,
            return_logprob=True,
        )
        ids, answer = await _generate_one(state, item)
        response = openai.completion_response(
            body, _model_name(body, settings), ids, answer, _token_texts(state, answer)
        )
        return JSONResponse(response)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> JSONResponse:
        body, sampling = openai.parse_chat(await _body(request))
        ids = body.get("input_ids") or _chat_prompt(state, body)
        item = GenerateItem(
            rid=body.get("rid") or _new_rid(), sampling=sampling, input_ids=ids, return_logprob=True
        )
        ids, answer = await _generate_one(state, item)
        response = openai.chat_response(
            body, _model_name(body, settings), ids, answer, _token_texts(state, answer)
        )
        return JSONResponse(response)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": settings.model_path, "object": "model", "owned_by": "miles"}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        ok = bool(state.engine.health().get("ok", True))
        return Response(status_code=200 if ok else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if state.host.paused or state.released:
            return _error(503, "paused or memory released: not generating")
        item = GenerateItem(rid=_new_rid(), sampling=wire.Sampling(max_new_tokens=1))
        first = int(state.tokenizer.bos_token_id or state.tokenizer.eos_token_id or 0)
        try:
            finished = await asyncio.wait_for(_submit(state, item, [first]), timeout=60)
        except (TimeoutError, NotServing, QueueFull) as exc:
            return _error(503, f"the engine did not generate: {exc}")
        return Response(status_code=200 if finished.error is None else 503)

    # -- information ---------------------------------------------------------------------------

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": settings.model_path,
                "tokenizer_path": settings.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": state.version_label,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": getattr(engine.model.config, "model_type", None),
                "architectures": getattr(engine.model.config, "architectures", None),
            }
        )

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def server_info() -> JSONResponse:
        health = state.engine.health()
        return JSONResponse(
            {
                "version": SGLANG_PROTOCOL,
                "served_by": "miles serve",
                "miles_sglang_version": package_version("miles-sglang"),
                "model_path": settings.model_path,
                "engine_path": getattr(engine, "path", None),
                "device": str(getattr(engine, "device", "")),
                "dtype": health.get("dtype"),
                "max_batch_size": settings.max_batch_size,
                "max_queue": settings.max_queue,
                "context_length": state.max_context,
                "weight_version": state.version_label,
                # SGLang's server argument of the same meaning.
                "enable_return_routed_experts": settings.record_routing,
                "paused": state.host.paused,
                "memory_released": state.released,
                "uptime_s": time.time() - state.started,
            }
        )

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": state.version_label})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await _body(request), wire.WEIGHT_VERSION_FIELDS, "/update_weight_version",
            required=("new_version",),
        )  # fmt: skip
        if body.get("abort_all_requests"):
            await run_in_threadpool(state.host.abort, None, True)
        state.version_label = body["new_version"]
        return _ok(f"weight version is {state.version_label!r}")

    # -- control -------------------------------------------------------------------------------

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        raw = await request.body()
        body = wire.check_fields(
            _json(raw) if raw.strip() else {}, wire.PAUSE_FIELDS, "/pause_generation"
        )
        mode = body.get("mode", "abort")
        if mode not in wire.PAUSE_MODES:
            raise BadRequest(
                f"/pause_generation: mode must be one of {wire.PAUSE_MODES}, got {mode!r}"
            )
        await run_in_threadpool(state.host.pause, mode)
        return _ok(f"paused ({mode})")

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        await run_in_threadpool(state.host.resume)
        return _ok("generation continues")

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache() -> Response:
        if state.host.busy:
            return _error(400, "requests are running: the cache is flushed only when idle; retry")
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        body = wire.check_fields(await _body(request), wire.ABORT_FIELDS, "/abort_request")
        if not body.get("abort_all") and not body.get("rid"):
            raise BadRequest("/abort_request: give 'rid' or 'abort_all': true")
        count = await run_in_threadpool(
            state.host.abort, body.get("rid"), bool(body.get("abort_all"))
        )
        return _ok(f"aborted {count} request(s)")

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> JSONResponse:
        raw = await request.body()
        body = wire.check_fields(
            _json(raw) if raw.strip() else {}, wire.MEMORY_FIELDS, "/release_memory_occupation"
        )
        _check_tags(body.get("tags"))
        if state.host.busy:
            raise BadRequest(
                "release_memory_occupation needs an idle engine: pause and drain first"
            )
        await state.lane.run("release_memory_occupation", lambda _: state.engine.release_memory())
        state.released = True
        return _ok("memory released")

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> JSONResponse:
        raw = await request.body()
        body = wire.check_fields(
            _json(raw) if raw.strip() else {}, wire.MEMORY_FIELDS, "/resume_memory_occupation"
        )
        _check_tags(body.get("tags"))
        await state.lane.run("resume_memory_occupation", lambda _: state.engine.resume_memory())
        state.released = False
        return _ok("memory resumed")

    # -- weights -------------------------------------------------------------------------------

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await _body(request), wire.INIT_GROUP_FIELDS, "/init_weights_update_group",
            required=("master_address", "master_port", "rank_offset", "world_size"),
        )  # fmt: skip
        name = body.get("group_name", "weight_update_group")
        if name in state.groups:
            raise BadRequest(f"weight-update group {name!r} exists: destroy it first")
        what = (
            f"init_weights_update_group (trainer at {body['master_address']}:{body['master_port']})"
        )
        try:
            group = await state.lane.run(
                what,
                lambda seconds_left: UpdateGroup(
                    name,
                    body["master_address"],
                    body["master_port"],
                    body["rank_offset"],
                    body["world_size"],
                    body.get("backend", "nccl"),
                    engine.device,
                    timeout_s=seconds_left,
                ),
            )
        except _ANSWERED:
            raise
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{what}: {exc} (miles serve --weight-timeout)") from None
        except Exception as exc:
            return _fail(f"joining weight-update group {name!r} failed: {exc}")
        state.groups[name] = group
        return _ok(f"joined weight-update group {name!r} as rank {body['rank_offset']}")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await _body(request), wire.DESTROY_GROUP_FIELDS, "/destroy_weights_update_group"
        )
        name = body.get("group_name", "weight_update_group")
        group = state.groups.pop(name, None)
        if group is None:
            raise BadRequest(f"no weight-update group {name!r}")
        await state.lane.run("destroy_weights_update_group", lambda _: group.close())
        return _ok(f"left weight-update group {name!r}")

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await _body(request), wire.UPDATE_DISTRIBUTED_FIELDS, "/update_weights_from_distributed",
            required=("names", "dtypes", "shapes"),
        )  # fmt: skip
        check_update(body["names"], body["dtypes"], body["shapes"])
        name = body.get("group_name", "weight_update_group")
        group = state.groups.get(name)
        if group is None:
            raise BadRequest(
                f"no weight-update group {name!r}: POST /init_weights_update_group first"
            )
        load_format = body.get("load_format")
        if load_format not in (None, "flattened_bucket"):
            raise BadRequest(f"load_format must be null or 'flattened_bucket', got {load_format!r}")
        if body.get("abort_all_requests"):
            await run_in_threadpool(state.host.abort, None, True)

        def receive_and_load(_: float) -> None:
            tensors = group.receive(
                body["names"], body["dtypes"], body["shapes"], load_format == "flattened_bucket"
            )
            _load(state, tensors)

        try:
            await state.lane.run("update_weights_from_distributed", receive_and_load)
        except _ANSWERED:
            raise
        except Exception as exc:
            return _fail(f"update_weights_from_distributed failed: {exc}")
        _new_label(state, body.get("weight_version"))
        return _ok(f"loaded {len(body['names'])} tensor(s)")

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await _body(request), wire.UPDATE_DISK_FIELDS, "/update_weights_from_disk",
            required=("model_path",),
        )  # fmt: skip
        if body.get("abort_all_requests"):
            await run_in_threadpool(state.host.abort, None, True)
        try:
            await state.lane.run(
                "update_weights_from_disk",
                lambda _: _load(state, safetensors_weights(body["model_path"])),
            )
        except _ANSWERED:
            raise
        except Exception as exc:
            return _fail(f"update_weights_from_disk failed: {exc}")
        _new_label(state, body.get("weight_version"))
        return _ok(f"loaded weights from {body['model_path']}")

    @app.get("/weights_checksum")
    async def weights_checksum() -> JSONResponse:
        """Miles' extension: the checksum Miles' trainer compares after a sync (SGLang has none)."""
        checksum = await run_in_threadpool(state.engine.weights_checksum)
        return JSONResponse({"checksum": checksum, "weight_version": state.version_label})

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await _body(request), wire.UPDATE_TENSOR_FIELDS, "/update_weights_from_tensor",
            required=("serialized_named_tensors",),
        )  # fmt: skip
        entries = body["serialized_named_tensors"]
        if len(entries) != 1 or not isinstance(entries[0], str):
            raise BadRequest(
                "serialized_named_tensors: one base64 string (this server is one tensor-parallel "
                f"rank), got {len(entries)} entries"
            )
        if body.get("load_format") is not None:
            raise BadRequest("load_format must be null here: send [(name, tensor)] pairs")
        if body.get("abort_all_requests"):
            await run_in_threadpool(state.host.abort, None, True)

        def load(_: float) -> int:
            try:
                named = load_named_tensors(entries[0])
            except PayloadRefused as exc:
                raise BadRequest(str(exc)) from None
            check_update(
                [n for n, _ in named],
                [str(t.dtype).removeprefix("torch.") for _, t in named],
                [list(t.shape) for _, t in named],
            )
            _load(state, iter(named))
            if any(t.is_cuda for _, t in named):  # copied out before the trainer reuses it
                torch.cuda.synchronize()
            return len(named)

        try:
            loaded = await state.lane.run("update_weights_from_tensor", load)
        except _ANSWERED:
            raise
        except Exception as exc:
            return _fail(f"update_weights_from_tensor failed: {exc}")
        _new_label(state, body.get("weight_version"))
        return _ok(f"loaded {loaded} tensor(s)")

    return app


# -- helpers -----------------------------------------------------------------------------------


def _exit_after(seconds: float) -> None:
    """End the process in `seconds` unless it has ended by then: a shutdown stuck on a
    collective or a load must not keep a server's process alive."""

    def stop() -> None:
        time.sleep(seconds)
        print(
            f"miles serve: shutdown took over {seconds:g} s; exiting", file=sys.stderr, flush=True
        )
        os._exit(1)

    threading.Thread(target=stop, name="miles-serve-exit", daemon=True).start()


def _new_rid() -> str:
    return secrets.token_hex(8)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(wire.error_body(message), status_code=status)


def _ok(message: str) -> JSONResponse:
    return JSONResponse({"success": True, "message": message})


def _fail(message: str, status: int = 400) -> JSONResponse:
    """SGLang's answer to a failed control call, with its error object beside it."""
    body = {"success": False, "message": message, **wire.error_body(message)}
    return JSONResponse(body, status_code=status)


# Errors with an answer of their own (400, 503, 504), not "the operation failed".
_ANSWERED = (BadRequest, LaneBusy, DeadlineExceeded)

# What a client may call without the key on a server whose `open_generation` is set: generating
# and reading what the server is. Everything else (pause, abort, memory, weights, versions)
# controls the server.
_GENERATION_PATHS = frozenset(
    {
        "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
        "/health_generate", "/get_model_info", "/model_info", "/get_server_info",
        "/server_info", "/get_weight_version", "/weight_version",
    }
)  # fmt: skip
# Bodies that are not JSON: tensors for /update_weights_from_tensor.
_RAW_BODY_PATHS = frozenset({"/update_weights_from_tensor"})
_LOOPBACK_NAMES = frozenset({*LOOPBACK, "[::1]"})  # a Host header brackets IPv6


def _refusal(request: Request, settings: ServeSettings) -> JSONResponse | None:
    """Why the request is refused before any endpoint sees it, as its error response; None to
    let it through."""
    headers, path = request.headers, request.url.path
    origin = headers.get("origin")
    if origin is not None and origin not in settings.allowed_origins:
        return _error(403, f"cross-origin request refused (Origin: {origin[:100]})")
    if settings.host is not None and settings.host not in ("0.0.0.0", "::", ""):
        name = (headers.get("host") or "").rsplit(":", 1)[0].lower()
        allowed = _LOOPBACK_NAMES if settings.host in _LOOPBACK_NAMES else {settings.host}
        if name not in allowed:
            return _error(403, f"Host {name[:100]!r} is not this server's address")
    key = settings.api_key
    open_path = path == "/health" or (settings.open_generation and path in _GENERATION_PATHS)
    if key and not open_path:
        given = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), key.encode()):
            return _error(401, "missing or wrong API key (Authorization: Bearer KEY)")
    length = headers.get("content-length", "")
    if request.method == "POST" and path not in _RAW_BODY_PATHS and length != "0":
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            return _error(415, "request bodies must be JSON (Content-Type: application/json)")
    if length.isdigit() and int(length) > settings.max_body_mb * 2**20:
        return _error(413, f"request body over {settings.max_body_mb:g} MB")
    return None


_DISCARD_FLOOR = 16 * 2**20


async def _discard_body(request: Request, settings: ServeSettings) -> None:
    """Read and drop a refused request's body, up to a bound, before answering: a client that
    sends its whole body before it reads (urllib, requests) then gets the 4xx instead of a broken
    pipe. A body past the bound is not read; the connection just closes."""
    cap = max(4 * settings.max_body_mb * 2**20, _DISCARD_FLOOR)
    length = request.headers.get("content-length", "")
    if request.method not in ("POST", "PUT", "PATCH") or (length.isdigit() and int(length) > cap):
        return
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > cap:
            return


def _reject_constant(name: str) -> Any:
    raise BadRequest(f"malformed JSON: {name} is not a JSON number")


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"malformed JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None


async def _body(request: Request) -> Any:
    limit = request.app.state.miles.settings.max_body_mb * 2**20
    chunks, size = [], 0
    async for chunk in request.stream():  # a body without Content-Length is capped here
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body over {limit / 2**20:g} MB")
        chunks.append(chunk)
    return _json(b"".join(chunks))


class BodyTooLarge(BadRequest):
    """A request body over `max_body_mb` (413)."""


def _check_tags(tags: Any) -> None:
    for tag in tags or ():
        if tag not in wire.MEMORY_TAGS:
            raise BadRequest(f"unknown memory tag {tag!r} (tags: {', '.join(wire.MEMORY_TAGS)})")


def _check_serving(state: _State) -> None:
    if state.released:
        raise NotServing("memory is released: POST /resume_memory_occupation first")


def _prompt_ids(state: _State, item: GenerateItem) -> list[int]:
    ids = item.input_ids
    if ids is None:
        ids = list(state.tokenizer(item.text)["input_ids"])
    vocab = int(getattr(state.engine.model.config, "vocab_size", 0) or 0)
    if vocab and any(not 0 <= t < vocab for t in ids):
        raise BadRequest(f"request {item.rid}: input_ids must be in [0, {vocab})")
    total = len(ids) + item.sampling.max_new_tokens
    if total > state.max_context:
        raise BadRequest(
            f"request {item.rid}: {len(ids)} prompt tokens + max_new_tokens "
            f"{item.sampling.max_new_tokens} = {total} exceeds the context length "
            f"{state.max_context}"
        )
    return ids


def _submit(
    state: _State, item: GenerateItem, prompt_ids: list[int], on_tokens: OnTokens | None = None
) -> asyncio.Future[Finished]:
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Finished] = loop.create_future()

    def settle(finished: Finished) -> None:
        if not future.done():  # the client may have gone
            future.set_result(finished)

    def deliver(finished: Finished) -> None:
        loop.call_soon_threadsafe(settle, finished)

    s = item.sampling
    stop_ids = s.stop_token_ids
    sampling = SamplingParams(
        temperature=0.0 if s.temperature < GREEDY_BELOW else s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_new_tokens=s.max_new_tokens,
        stop_token_ids=stop_ids,
        stop_strings=s.stop,
        seed=s.seed,
    )
    state.host.submit(item.rid, prompt_ids, sampling, deliver, on_tokens)
    return future


async def _generate_one(state: _State, item: GenerateItem) -> tuple[list[int], dict[str, Any]]:
    """One prompt through the engine: its token ids and its /generate answer."""
    _check_serving(state)
    ids = _prompt_ids(state, item)
    done = await _submit(state, item, ids)
    return ids, _answer(state, item, done)


def _chat_prompt(state: _State, body: dict[str, Any]) -> list[int]:
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise BadRequest(
            "/v1/chat/completions: this model's tokenizer has no chat template; send the "
            "prompt's token ids as input_ids"
        )
    ids = tok.apply_chat_template(
        body["messages"],
        tools=body.get("tools"),
        add_generation_prompt=True,
        tokenize=True,
        **(body.get("chat_template_kwargs") or {}),
    )
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _token_texts(state: _State, answer: dict[str, Any]) -> list[str]:
    return [state.tokenizer.decode([t]) for t in answer["output_ids"]]


def _model_name(body: dict[str, Any], settings: ServeSettings) -> str:
    return str(body.get("model") or settings.model_path)


def _answer(state: _State, item: GenerateItem, done: Finished) -> dict[str, Any]:
    """SGLang's /generate response object for one finished prompt."""
    tok, s = state.tokenizer, item.sampling
    text = tok.decode(
        done.response_ids,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
    )
    matched: int | str | None = None
    if done.finish_reason == "stop":
        last = done.response_ids[-1] if done.response_ids else None
        hit = next((x for x in s.stop if x in text), None)
        if hit is not None and last not in s.stop_token_ids:
            matched = hit
            if not s.no_stop_trim:  # SGLang cuts a matched stop string from the text
                text = text[: text.find(hit)]
        else:
            matched = last
    meta: dict[str, Any] = {
        "id": done.rid,
        "finish_reason": wire.finish_reason(done.finish_reason, matched, s.max_new_tokens),
        "prompt_tokens": len(done.prompt_ids),
        "completion_tokens": len(done.response_ids),
        "cached_tokens": done.cached_tokens,
        "weight_version": state.version_label,
        "e2e_latency": time.perf_counter() - done.started,
    }
    if done.error is not None:
        meta["finish_reason"]["message"] = f"the engine failed: {done.error}"
    if item.return_logprob:
        meta["output_token_logprobs"] = [
            [float(lp), int(t), tok.decode([t]) if item.return_text_in_logprobs else None]
            for lp, t in zip(done.logprobs, done.response_ids, strict=True)
        ]
    if item.return_routed_experts and done.routing is not None:
        rows = len(done.prompt_ids) + len(done.response_ids) - 1
        routes = np.ascontiguousarray(np.asarray(done.routing)[:rows], dtype=np.int32)
        meta["routed_experts"] = wire.encode_routed_experts(routes.tobytes())
    return {"text": text, "output_ids": list(done.response_ids), "meta_info": meta}


class _Progress:
    """A streamed prompt's latest tokens, handed from the engine's thread to the event loop.
    Only the newest state is kept: a slow client gets fewer, fuller chunks."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.changed = asyncio.Event()
        self.ids: list[int] = []
        self.logprobs: list[float] = []

    def update(self, ids: list[int], logprobs: list[float]) -> None:  # on the engine's thread
        snapshot = (list(ids), list(logprobs))
        self._loop.call_soon_threadsafe(self._set, snapshot)

    def _set(self, snapshot: tuple[list[int], list[float]]) -> None:
        self.ids, self.logprobs = snapshot
        self.changed.set()


async def _stream(
    state: _State,
    item: GenerateItem,
    prompt_tokens: int,
    wait: asyncio.Future[Finished],
    progress: _Progress,
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
            chunk = _partial(state, item, prompt_tokens, progress.ids, progress.logprobs)
            yield f"data: {json.dumps(chunk)}\n\n".encode()
    yield f"data: {json.dumps(_answer(state, item, wait.result()))}\n\n".encode()
    yield b"data: [DONE]\n\n"


def _partial(
    state: _State, item: GenerateItem, prompt_tokens: int, ids: list[int], logprobs: list[float]
) -> dict[str, Any]:
    """A streamed chunk before the end: the answer so far, finish_reason null."""
    tok, s = state.tokenizer, item.sampling
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
    text = tok.decode(
        ids,
        skip_special_tokens=s.skip_special_tokens,
        spaces_between_special_tokens=s.spaces_between_special_tokens,
    )
    return {"text": text, "output_ids": list(ids), "meta_info": meta}


def _load(state: _State, tensors: Any) -> None:
    """Weights into the engine, under a new internal version (requests record it)."""
    state.engine.load_weights(tensors, state.engine.weight_version + 1)


def _new_label(state: _State, label: str | None) -> None:
    if label is not None:
        state.version_label = label
