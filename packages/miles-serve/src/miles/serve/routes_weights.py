"""`miles serve`'s weight endpoints: a trainer's weight-update group (NCCL or gloo broadcasts),
weights from disk, from tensors by reference, and the checksum Miles' trainer verifies."""

from __future__ import annotations

from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from miles.serve.serving import (
    ServeState,
    fail,
    ok,
    read_body,
)
from miles.serve.weight_lane import DeadlineExceeded, LaneBusy
from miles.serve.weights import UpdateGroup, check_update, safetensors_weights
from miles.sglang import control_protocol as control
from miles.sglang import protocol as wire
from miles.sglang.protocol import BadRequest
from miles.sglang.tensors import PayloadRefused, load_named_tensors


def add_group_routes(app: FastAPI, state: ServeState) -> None:
    """The weight-update group: join, leave, receive broadcast weights."""
    engine = state.engine

    @app.post("/init_weights_update_group")
    async def init_group(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), control.INIT_GROUP_FIELDS, "/init_weights_update_group",
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
            await read_body(request), control.DESTROY_GROUP_FIELDS, "/destroy_weights_update_group"
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
            await read_body(request), control.UPDATE_DISTRIBUTED_FIELDS, "/update_weights_from_distributed",
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


def add_load_routes(app: FastAPI, state: ServeState) -> None:
    """Weights from disk or from tensors, and their checksum."""

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: Request) -> JSONResponse:
        body = wire.check_fields(
            await read_body(request), control.UPDATE_DISK_FIELDS, "/update_weights_from_disk",
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
            await read_body(request), control.UPDATE_TENSOR_FIELDS, "/update_weights_from_tensor",
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


def _load(state: ServeState, tensors: Any) -> None:
    """Weights into the engine, under a new internal version (requests record it)."""
    state.engine.load_weights(tensors, state.engine.weight_version + 1)


def _new_label(state: ServeState, label: str | None) -> None:
    if label is not None:
        state.version_label = label
