"""`miles serve`'s information, control and weight endpoints (SGLang's names and bodies)."""

from __future__ import annotations

import time
from importlib.metadata import version as package_version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from miles.serve.routes_weights import add_group_routes, add_load_routes
from miles.serve.serving import (
    SGLANG_PROTOCOL,
    ServeState,
    error,
    ok,
    parse_json,
    read_body,
)
from miles.sglang import control_protocol as control
from miles.sglang import protocol as wire
from miles.sglang.protocol import BadRequest


def add_admin_routes(app: FastAPI, state: ServeState) -> None:
    """Information, control and weight endpoints."""
    add_info_routes(app, state)
    add_control_routes(app, state)
    add_group_routes(app, state)
    add_load_routes(app, state)


def add_info_routes(app: FastAPI, state: ServeState) -> None:
    settings, engine = state.settings, state.engine
    # -- information ---------------------------------------------------------------------------

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": state.model_path,
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
        # SGLang's KV pool size in tokens (what /get_memory_pool_size answers). The hf path has
        # no pool (it allocates per batch): the context length, the most one request may hold.
        pool = health.get("kv_cache_tokens")
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
                "max_total_num_tokens": int(pool) if pool is not None else state.max_context,
                "weight_version": state.version_label,
                # SGLang's server argument of the same meaning.
                "enable_return_routed_experts": settings.record_routing,
                "paused": state.host.paused,
                "memory_released": state.released,
                "uptime_s": time.time() - state.started,
            }
        )

    @app.get("/get_memory_pool_size")
    async def memory_pool_size() -> JSONResponse:
        """SGLang's answer: the KV cache's capacity in tokens (a bare number)."""
        tokens = state.engine.health().get("kv_cache_tokens")
        if tokens is None:
            raise BadRequest(
                "this engine has no KV memory pool: the hf path allocates per batch (start "
                "miles serve on the paged path for a pool)"
            )
        return JSONResponse(int(tokens))

    @app.get("/get_weight_version")
    @app.get("/weight_version")
    async def weight_version() -> JSONResponse:
        return JSONResponse({"weight_version": state.version_label})

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), control.WEIGHT_VERSION_FIELDS, "/update_weight_version",
            required=("new_version",),
        )  # fmt: skip
        if body.get("abort_all_requests"):
            await run_in_threadpool(state.host.abort, None, True)
        state.version_label = body["new_version"]
        return ok(f"weight version is {state.version_label!r}")


def add_control_routes(app: FastAPI, state: ServeState) -> None:
    # -- control -------------------------------------------------------------------------------

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        raw = await request.body()
        body = wire.check_fields(
            parse_json(raw) if raw.strip() else {}, control.PAUSE_FIELDS, "/pause_generation"
        )
        mode = body.get("mode", "abort")
        if mode not in control.PAUSE_MODES:
            raise BadRequest(
                f"/pause_generation: mode must be one of {control.PAUSE_MODES}, got {mode!r}"
            )
        await run_in_threadpool(state.host.pause, mode)
        return ok(f"paused ({mode})")

    @app.post("/continue_generation")
    async def continue_generation() -> JSONResponse:
        await run_in_threadpool(state.host.resume)
        return ok("generation continues")

    @app.post("/flush_cache")
    @app.get("/flush_cache")
    async def flush_cache() -> Response:
        if state.host.busy:
            return error(400, "requests are running: the cache is flushed only when idle; retry")
        return Response("Cache flushed.\n", status_code=200)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> JSONResponse:
        body = wire.check_fields(await read_body(request), control.ABORT_FIELDS, "/abort_request")
        if not body.get("abort_all") and not body.get("rid"):
            raise BadRequest("/abort_request: give 'rid' or 'abort_all': true")
        count = await run_in_threadpool(
            state.host.abort, body.get("rid"), bool(body.get("abort_all"))
        )
        return ok(f"aborted {count} request(s)")

    @app.post("/release_memory_occupation")
    async def release_memory(request: Request) -> JSONResponse:
        raw = await request.body()
        body = wire.check_fields(
            parse_json(raw) if raw.strip() else {},
            control.MEMORY_FIELDS,
            "/release_memory_occupation",
        )
        _check_tags(body.get("tags"))
        if state.host.busy:
            raise BadRequest(
                "release_memory_occupation needs an idle engine: pause and drain first"
            )
        await state.lane.run("release_memory_occupation", lambda _: state.engine.release_memory())
        state.released = True
        return ok("memory released")

    @app.post("/resume_memory_occupation")
    async def resume_memory(request: Request) -> JSONResponse:
        raw = await request.body()
        body = wire.check_fields(
            parse_json(raw) if raw.strip() else {},
            control.MEMORY_FIELDS,
            "/resume_memory_occupation",
        )
        _check_tags(body.get("tags"))
        await state.lane.run("resume_memory_occupation", lambda _: state.engine.resume_memory())
        state.released = False
        return ok("memory resumed")


def _check_tags(tags: Any) -> None:
    for tag in tags or ():
        if tag not in control.MEMORY_TAGS:
            raise BadRequest(f"unknown memory tag {tag!r} (tags: {', '.join(control.MEMORY_TAGS)})")
