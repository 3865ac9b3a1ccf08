"""`miles serve`'s HTTP application: SGLang's native endpoints over Miles' torch engine.

Starlette/FastAPI routes, each a thin shell: the body is checked against the protocol's field
lists (`protocol.py`: a 400 with SGLang's error object for malformed JSON, unknown fields, wrong
types, bad values), the work goes to the `EngineHost` (generation) or to the engine itself
(weights, memory), blocking calls on worker threads so the event loop keeps serving `/health`.
The routes live in `routes_generate.py` and `routes_admin.py`; what they share in `serving.py`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from miles.serve.host import EngineHost, NotServing, QueueFull
from miles.serve.responses_api import add_responses_route
from miles.serve.routes_admin import add_admin_routes
from miles.serve.routes_generate import add_generation_routes
from miles.serve.routes_openai import add_openai_routes
from miles.serve.serving import (
    BodyTooLarge,
    ServeSettings,
    ServeState,
    error,
    fail,
)
from miles.serve.weight_lane import DeadlineExceeded, LaneBusy, WeightLane
from miles.sglang.protocol import BadRequest, NotFound
from miles.sglang.serve_keys import LOOPBACK
from miles.torch.engine.loader import eos_token_ids

__all__ = ["ServeSettings", "build_app"]


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
    state = ServeState(
        engine=engine,
        host=EngineHost(engine, settings.max_batch_size, settings.max_queue),
        settings=settings,
        tokenizer=engine.tokenizer,
        max_context=max_context,
        lane=WeightLane(settings.weight_timeout_s),
        eos_ids=tuple(eos_token_ids(engine.model, engine.tokenizer)),
        model_path=settings.model_path,
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
    async def bad_request(request: Request, exc: BadRequest) -> JSONResponse:
        status = 413 if isinstance(exc, BodyTooLarge) else 404 if isinstance(exc, NotFound) else 400
        if request.url.path in _RESULT_PATHS:  # SGLang's {"success": false, "message"} contract
            return fail(str(exc), status)
        return error(status, str(exc), request.url.path, getattr(exc, "param", None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and methods: SGLang's error object, not the framework's {"detail"}.
        what = f"{request.method} {request.url.path}"
        reason = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
        return error(exc.status_code, f"{what}: {reason}", request.url.path)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, not the client's: say what broke, in SGLang's error object.
        return error(500, f"internal error: {type(exc).__name__}: {exc}", request.url.path)

    @app.exception_handler(NotServing)
    async def not_serving(request: Request, exc: NotServing) -> JSONResponse:
        return error(503, str(exc), request.url.path)

    @app.exception_handler(LaneBusy)
    async def lane_busy(_: Request, exc: LaneBusy) -> JSONResponse:
        return fail(str(exc), 503)

    @app.exception_handler(DeadlineExceeded)
    async def deadline(_: Request, exc: DeadlineExceeded) -> JSONResponse:
        return fail(str(exc), 504)

    @app.exception_handler(QueueFull)
    async def queue_full(request: Request, exc: QueueFull) -> JSONResponse:
        return error(503, str(exc), request.url.path)

    add_generation_routes(app, state)
    add_openai_routes(app, state)
    add_responses_route(app, state)
    add_admin_routes(app, state)
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


# Endpoints that answer SGLang's {"success", "message"} object, failures included.
_RESULT_PATHS = frozenset(
    {
        "/update_weights_from_disk", "/update_weights_from_distributed",
        "/update_weights_from_tensor", "/init_weights_update_group",
        "/destroy_weights_update_group", "/update_weight_version", "/pause_generation",
        "/continue_generation", "/abort_request", "/release_memory_occupation",
        "/resume_memory_occupation",
    }
)  # fmt: skip

# What a client may call without the key on a server whose `open_generation` is set: generating
# and reading what the server is. Everything else (pause, abort, memory, weights, versions)
# controls the server.
_GENERATION_PATHS = frozenset(
    {
        "/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
        "/health_generate", "/get_model_info", "/model_info", "/get_server_info",
        "/server_info", "/get_weight_version", "/weight_version", "/v1/responses", "/v1/score",
        "/get_memory_pool_size",
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
        return error(403, f"cross-origin request refused (Origin: {origin[:100]})", path)
    if settings.host is not None and settings.host not in ("0.0.0.0", "::", ""):
        name = (headers.get("host") or "").rsplit(":", 1)[0].lower()
        allowed = _LOOPBACK_NAMES if settings.host in _LOOPBACK_NAMES else {settings.host}
        if name not in allowed:
            return error(403, f"Host {name[:100]!r} is not this server's address", path)
    key = settings.api_key
    generation = path in _GENERATION_PATHS or path.startswith(("/v1/models/", "/v1/responses/"))
    open_path = path == "/health" or (settings.open_generation and generation)
    if key and not open_path:
        given = headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(given.encode(), key.encode()):
            return error(401, "missing or wrong API key (Authorization: Bearer KEY)", path)
    length = headers.get("content-length", "")
    if request.method == "POST" and path not in _RAW_BODY_PATHS and length != "0":
        kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind != "application/json":
            return error(415, "request bodies must be JSON (Content-Type: application/json)", path)
    if length.isdigit() and int(length) > settings.max_body_mb * 2**20:
        return error(413, f"request body over {settings.max_body_mb:g} MB", path)
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
