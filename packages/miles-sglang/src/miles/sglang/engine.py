"""Rollout backend `sglang`: a `RolloutEngine` that drives one SGLang server (or `miles serve`)
over SGLang's HTTP protocol. The run's engine k attaches to `rollout.urls[k]`, or, without urls,
launches its own server on its actor's GPUs (`miles.sglang.launcher`) and stops it with itself.

- generate: one `/generate` per request (token ids in, token ids and logprobs out), many in
  flight at once, each result handed on as it returns;
- pause: `/pause_generation` with mode `abort`, so running requests come back with their tokens
  so far (what Miles' partial rollouts resume from); resume: `/continue_generation`;
- weight sync: the server joins the trainer's weight-update group (`/init_weights_update_group`,
  the trainer rank 0) and takes each bucket of the sync plan as one flattened broadcast
  (`/update_weights_from_distributed`, `load_format: flattened_bucket`); colocated, each bucket
  arrives by reference (`/update_weights_from_tensor`, CUDA IPC; a shared-memory file on the
  CPU); the version is the label `/update_weight_version` sets;
- verification: `/weights_checksum`, an endpoint of `miles serve` (SGLang has none: set
  `rollout.verify_weights: false` against SGLang itself).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog

from miles.core.contracts.backends import EngineUnavailable, RolloutSetup
from miles.core.contracts.types import GenerateRequest, GenerateResult
from miles.core.contracts.weight_sync import SyncPlan
from miles.sglang.config import MIN_SGLANG, SGLangConfig
from miles.sglang.launcher import LaunchedServer
from miles.sglang.serve_keys import key_for_url
from miles.sglang.tensors import serialize_bucket

log = structlog.get_logger(__name__)

GROUP_NAME = "weight_update_group"  # the trainer's group (miles.torch.sync.group.GROUP_NAME)


class ServerError(RuntimeError):
    """An SGLang server answered with an error."""


class ServerUnavailable(ServerError, EngineUnavailable):
    """No answer at all (refused, reset, closed): the run treats the engine as failed."""


class SGLangClient:
    """JSON over HTTP to one server."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.headers = {"Content-Type": "application/json"}
        api_key = api_key or key_for_url(url)  # a local `miles serve` that made its own key
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def call(self, path: str, body: Any = None, *, method: str | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method=method or ("GET" if data is None else "POST"),
            headers=self.headers,
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as err:
            raise ServerError(f"{self.url}{path}: HTTP {err.code}: {_message(err)}") from None
        except (OSError, http.client.HTTPException) as err:
            # HTTPException: the server died mid-answer (IncompleteRead, BadStatusLine).
            raise ServerUnavailable(f"{self.url}{path}: {err!r}") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


def _message(err: urllib.error.HTTPError) -> str:
    text = err.read().decode(errors="replace")
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:500]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in body:
            return str(body["message"])
    return text[:500]


class SGLangEngine:
    """A `miles.core.contracts.backends.RolloutEngine` over one SGLang server."""

    def __init__(self, config: SGLangConfig, setup: RolloutSetup) -> None:
        self.server: LaunchedServer | None = None
        if not config.urls:
            self.server = LaunchedServer.start(config, setup)
            url = self.server.url
            log.info(
                "server launched",
                engine=setup.index,
                url=url,
                server=config.server,
                supervisor_pid=self.server.process.pid,
                log_file=str(self.server.log),
            )
        elif setup.index < len(config.urls):
            url = config.urls[setup.index]
        else:
            raise ValueError(
                f"rollout engine {setup.index} has no server: rollout.urls lists "
                f"{len(config.urls)} (one per engine; set rollout.engines to their number)"
            )
        self.config, self.setup = config, setup
        self.client = SGLangClient(url, config.api_key, config.request_timeout_s)
        try:
            self.info = self.client.call("/get_server_info")
            self._routes = _RouteShape.of(setup) if setup.record_routing != "off" else None
            problems = _info_problems(self.client.url, self.info, self._routes is not None)
            if problems:
                raise ServerError("; ".join(problems))
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(config.max_in_flight, thread_name_prefix="sglang")
        self._paused = False
        self._version = _version_number(self.client.call("/get_weight_version"))

    # -- generation ----------------------------------------------------------------------------

    @property
    def weight_version(self) -> int:
        return self._version

    def generate(self, requests: list[GenerateRequest]) -> Iterator[list[GenerateResult]]:
        if self._paused:
            raise RuntimeError("engine is paused: call resume() before generate()")
        futures = {self._pool.submit(self._one, r): r for r in requests}
        return self._as_finished(futures)

    def _as_finished(
        self, futures: dict[Future[GenerateResult], GenerateRequest]
    ) -> Iterator[list[GenerateResult]]:
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            yield [f.result() for f in done]

    def _one(self, request: GenerateRequest) -> GenerateResult:
        s = request.sampling
        body = {
            "input_ids": request.prompt_ids,
            "sampling_params": {
                "max_new_tokens": s.max_new_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "min_p": s.min_p,
                "stop_token_ids": list(s.stop_token_ids),
                "stop": list(s.stop_strings),
                "no_stop_trim": True,
                "skip_special_tokens": False,
                "spaces_between_special_tokens": False,
                "sampling_seed": s.seed,
            },
            "return_logprob": True,
            "return_routed_experts": self._routes is not None,
        }
        if request.cache_salt is not None:
            body["cache_salt"] = request.cache_salt
        out = self.client.call("/generate", body)
        meta = out["meta_info"]
        entries = meta.get("output_token_logprobs") or []
        response = [int(t) for t in out["output_ids"]]
        routing = None
        if self._routes is not None and meta.get("routed_experts"):
            routing = self._routes.decode(
                meta["routed_experts"], len(request.prompt_ids) + len(response)
            )
        return GenerateResult(
            request_id=request.request_id,
            response_ids=response,
            logprobs=[float(e[0]) for e in entries],
            finish_reason=str(meta["finish_reason"]["type"]),
            weight_version=_version_number(meta),
            routing=routing,
            cached_tokens=int(meta.get("cached_tokens", 0)),
        )

    def pause(self) -> None:
        self._paused = True
        self.client.call("/pause_generation", {"mode": "abort"})

    def resume(self) -> None:
        self.client.call("/continue_generation", {})
        self._paused = False

    def release_memory(self) -> None:
        self.client.call("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self.client.call("/resume_memory_occupation", {})

    def health(self) -> dict[str, Any]:
        if self.server is not None and not self.server.alive():
            raise ServerUnavailable(
                f"the launched server {self.client.url} exited with code "
                f"{self.server.process.returncode}; its log ({self.server.log}) ends:\n"
                f"{self.server.tail(5)}"
            )
        info = self.client.call("/get_server_info")
        return {
            "ok": True,
            "paused": self._paused,
            "dtype": str(info.get("dtype") or self.setup.precision.rollout_dtype),
            "url": self.client.url,
            "weight_version": self._version,
            "served_by": info.get("served_by", "sglang"),
            "launched": self.server is not None,
        }

    def close(self) -> None:
        """Stops a launched server (an attached one is left running)."""
        if self.server is not None:
            self.server.stop()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def get_rng_state(self) -> str:
        return ""  # the server's sampling RNG is its own: not saved with the run

    def set_rng_state(self, state: str) -> None:
        del state

    # -- weight sync ---------------------------------------------------------------------------

    def join_weight_sync(self, host: str, port: int, world_size: int, rank: int) -> None:
        """Leaves the server's last group (a rebuilt group, after a member changed, reuses the
        name), then joins the new one."""
        self.leave_weight_sync()
        answer = self.client.call(
            "/init_weights_update_group",
            {
                "master_address": host,
                "master_port": port,
                "rank_offset": rank,
                "world_size": world_size,
                "group_name": GROUP_NAME,
                "backend": "nccl" if self.setup.device.startswith("cuda") else "gloo",
            },
        )
        if not answer.get("success", False):
            raise ServerError(
                f"{self.client.url}: joining the weight-update group failed: {answer}"
            )

    def leave_weight_sync(self) -> None:
        with contextlib.suppress(ServerError):  # no group: never joined, or already gone
            self.client.call("/destroy_weights_update_group", {"group_name": GROUP_NAME})

    def receive_weights(self, plan: SyncPlan, version: int) -> None:
        """Each bucket as one flattened broadcast, in plan order (the trainer sends them so)."""
        for index, bucket in enumerate(plan.buckets):
            last = index == len(plan.buckets) - 1
            answer = self.client.call(
                "/update_weights_from_distributed",
                {
                    "names": [t.name for t in bucket.tensors],
                    "dtypes": [bucket.dtype] * len(bucket.tensors),
                    "shapes": [list(t.shape) for t in bucket.tensors],
                    "group_name": GROUP_NAME,
                    "load_format": "flattened_bucket",
                    "flush_cache": last,
                    "weight_version": str(version) if last else None,
                },
            )
            if not answer.get("success", False):
                raise ServerError(f"{self.client.url}: weight update failed: {answer}")
        self._version = version

    def load_bucket(self, plan: SyncPlan, index: int, handle: Any) -> None:
        """Colocated: the trainer's bucket by reference (`update_weights_from_tensor`); the
        server maps it, copies it into its weights, and answers once the memory is free."""
        answer = self.client.call(
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": [serialize_bucket(plan.buckets[index], handle)],
                "load_format": None,
                "flush_cache": index == len(plan.buckets) - 1,
            },
        )
        if not answer.get("success", False):
            raise ServerError(f"{self.client.url}: weight update failed: {answer}")

    def set_weight_version(self, version: int) -> None:
        self.client.call("/update_weight_version", {"new_version": str(version)})
        self._version = version

    def weights_checksum(self) -> str:
        try:
            return str(self.client.call("/weights_checksum")["checksum"])
        except ServerError as exc:
            raise ServerError(
                f"{exc}. Weight verification needs /weights_checksum, which `miles serve` has and "
                "SGLang does not: set rollout.verify_weights: false against SGLang"
            ) from None


def server_problems(url: str, api_key: str | None, routes: bool) -> list[str]:
    """What keeps the server at `url` from serving a run, checked before launch."""
    try:
        info = SGLangClient(url, api_key, timeout_s=10).call("/get_server_info")
    except ServerError as exc:
        return [
            f"rollout server {url} does not answer ({exc}): start it (`miles serve MODEL "
            "--port PORT`, or SGLang) or fix rollout.urls"
        ]
    return _info_problems(url, info, routes)


def _info_problems(url: str, info: dict[str, Any], routes: bool) -> list[str]:
    problems = []
    version = str(info.get("version", ""))
    if _release(version) < _release(MIN_SGLANG):
        problems.append(
            f"{url} runs SGLang {version or '(no version given)'}; rollout backend sglang needs "
            f"SGLang >= {MIN_SGLANG} (pause modes, flattened-bucket weight updates, weight "
            "versions)"
        )
    if routes and not info.get("enable_return_routed_experts"):
        problems.append(
            f"{url} does not return routed experts, which routing replay needs: start it with "
            "`miles serve --record-routing` (SGLang: --enable-return-routed-experts), or set "
            "moe.routing_replay: off"
        )
    return problems


def _version_number(meta: dict[str, Any]) -> int:
    """The weight version label as Miles' integer version ("default", before any sync: 0)."""
    label = str(meta.get("weight_version", "default"))
    return int(label) if label.isdigit() else 0


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "0.5.2rc1"; () when there is none."""
    parts = []
    for part in version.split(".")[:2]:
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True)
class _RouteShape:
    """How SGLang's `routed_experts` (base64 int32, one row per token fed through the model:
    prompt + completion - 1) becomes Miles' routing record ([tokens, moe_layers, top_k], the last
    sampled token's row -1, the smallest integer dtype that holds the experts)."""

    top_k: int
    dtype: np.dtype[Any]

    @classmethod
    def of(cls, setup: RolloutSetup) -> _RouteShape:
        if setup.record_routing != "ids":
            raise ValueError(
                f"rollout backend sglang records expert ids only (moe.routing_replay gives "
                f"record_routing={setup.record_routing!r})"
            )
        config = json.loads((Path(setup.model_path) / "config.json").read_text())
        config = config.get("text_config", config)
        experts = next(
            (int(config[k]) for k in ("num_experts", "n_routed_experts", "num_local_experts")
             if config.get(k)),
            2**31 - 1,
        )  # fmt: skip
        return cls(int(config["num_experts_per_tok"]), np.dtype(np.min_scalar_type(-experts)))

    def decode(self, encoded: str, tokens: int) -> npt.NDArray[np.integer[Any]]:
        fed = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        rows = fed.reshape(tokens - 1, -1, self.top_k)
        record = np.full((tokens, *rows.shape[1:]), -1, dtype=self.dtype)
        record[: tokens - 1] = rows
        return record
