"""`miles serve`'s information, control and weight endpoints (SGLang's names and bodies)."""

from __future__ import annotations

import time
from importlib.metadata import version as package_version
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from miles.sglang import protocol as wire
from miles.sglang.protocol import BadRequest
from miles.sglang.serving import (
    SGLANG_PROTOCOL,
    ServeState,
    error,
    fail,
    ok,
    parse_json,
    read_body,
)
from miles.sglang.tensors import PayloadRefused, load_named_tensors
from miles.sglang.weight_lane import DeadlineExceeded, LaneBusy
from miles.sglang.weights import UpdateGroup, check_update, safetensors_weights


def add_admin_routes(app: FastAPI, state: ServeState) -> None:
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
            await read_body(request), wire.WEIGHT_VERSION_FIELDS, "/update_weight_version",
            required=("new_version",),
        )  # fmt: skip
        if body.get("abort_all_requests"):
            await run_in_threadpool(state.host.abort, None, True)
        state.version_label = body["new_version"]
        return ok(f"weight version is {state.version_label!r}")

    # -- control -------------------------------------------------------------------------------

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        raw = await request.body()
        body = wire.check_fields(
            parse_json(raw) if raw.strip() else {}, wire.PAUSE_FIELDS, "/pause_generation"
        )
        mode = body.get("mode", "abort")
        if mode not in wire.PAUSE_MODES:
            raise BadRequest(
                f"/pause_generation: mode must be one of {wire.PAUSE_MODES}, got {mode!r}"
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
        body = wire.check_fields(await read_body(request), wire.ABORT_FIELDS, "/abort_request")
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
            parse_json(raw) if raw.strip() else {}, wire.MEMORY_FIELDS, "/release_memory_occupation"
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
            parse_json(raw) if raw.strip() else {}, wire.MEMORY_FIELDS, "/resume_memory_occupation"
        )
        _check_tags(body.get("tags"))
        await state.lane.run("resume_memory_occupation", lambda _: state.engine.resume_memory())
        state.released = False
        return ok("memory resumed")

    # -- weights -------------------------------------------------------------------------------

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), wire.INIT_GROUP_FIELDS, "/init_weights_update_group",
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
            return fail(f"joining weight-update group {name!r} failed: {exc}")
        state.groups[name] = group
        return ok(f"joined weight-update group {name!r} as rank {body['rank_offset']}")

    @app.post("/destroy_weights_update_group")
    async def destroy_group(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), wire.DESTROY_GROUP_FIELDS, "/destroy_weights_update_group"
        )
        name = body.get("group_name", "weight_update_group")
        group = state.groups.pop(name, None)
        if group is None:
            raise BadRequest(f"no weight-update group {name!r}")
        await state.lane.run("destroy_weights_update_group", lambda _: group.close())
        return ok(f"left weight-update group {name!r}")

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), wire.UPDATE_DISTRIBUTED_FIELDS, "/update_weights_from_distributed",
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
            return fail(f"update_weights_from_distributed failed: {exc}")
        _new_label(state, body.get("weight_version"))
        return ok(f"loaded {len(body['names'])} tensor(s)")

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), wire.UPDATE_DISK_FIELDS, "/update_weights_from_disk",
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
            return fail(f"update_weights_from_disk failed: {exc}")
        _new_label(state, body.get("weight_version"))
        state.model_path = body["model_path"]  # SGLang: the model now served
        return ok(f"loaded weights from {body['model_path']}")

    @app.get("/weights_checksum")
    async def weights_checksum() -> JSONResponse:
        """Miles' extension: the checksum Miles' trainer compares after a sync (SGLang has none)."""
        checksum = await run_in_threadpool(state.engine.weights_checksum)
        return JSONResponse({"checksum": checksum, "weight_version": state.version_label})

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), wire.UPDATE_TENSOR_FIELDS, "/update_weights_from_tensor",
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
            return fail(f"update_weights_from_tensor failed: {exc}")
        _new_label(state, body.get("weight_version"))
        return ok(f"loaded {loaded} tensor(s)")


# Errors with an answer of their own (400, 503, 504), not "the operation failed".
_ANSWERED = (BadRequest, LaneBusy, DeadlineExceeded)


def _check_tags(tags: Any) -> None:
    for tag in tags or ():
        if tag not in wire.MEMORY_TAGS:
            raise BadRequest(f"unknown memory tag {tag!r} (tags: {', '.join(wire.MEMORY_TAGS)})")


def _load(state: ServeState, tensors: Any) -> None:
    """Weights into the engine, under a new internal version (requests record it)."""
    state.engine.load_weights(tensors, state.engine.weight_version + 1)


def _new_label(state: ServeState, label: str | None) -> None:
    if label is not None:
        state.version_label = label
