"""`TorchRolloutEngine`: a plain PyTorch + transformers rollout engine with continuous batching.

Two generation loops (`TorchEngineConfig.path`): hf, transformers' forward and cache with
continuous batching by rows (`hf`), and paged (`paged`). Both sample in `sampler`, apply what a
request asks beyond plain sampling in `logits`, and end responses in `stops`.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

import structlog
import torch
from transformers import DynamicCache

from miles.core.config import LoRAConfig, ReplayMode
from miles.core.contracts.backends import Precision
from miles.core.contracts.types import GenerateRequest, GenerateResult
from miles.core.contracts.weight_sync import SyncPlan
from miles.precision.lora import AdapterApplier
from miles.torch.engine.batch import Batch, Row, batching_mode
from miles.torch.engine.config import EnginePath, TorchEngineConfig
from miles.torch.engine.hf import HFLoop
from miles.torch.engine.loader import (
    cache_kwarg,
    copy_weights,
    eos_token_ids,
    load_model,
    resolve_dtype,
)
from miles.torch.engine.logits import result_fields
from miles.torch.engine.paged.runner import PagedRunner
from miles.torch.engine.paged.sequence import Sequence, Status
from miles.torch.engine.path import choose_path
from miles.torch.engine.stops import StopChecker, check_request
from miles.torch.routing import RoutingRecorder, index_dtype, router_adapter
from miles.torch.sync.checksum import tensors_checksum
from miles.torch.sync.receiver import WeightReceiver
from miles.torch.weights import named_state


class Progress(Protocol):
    """A request's progress after a model step: (request id, response ids so far, their
    logprobs), and only for a request that asked for top logprobs or prompt logprobs a fourth
    argument, its `logits.result_fields` so far (the engine's own lists: copy what you keep)."""

    def __call__(
        self,
        request_id: int,
        response_ids: list[int],
        logprobs: list[float],
        extras: dict[str, Any] | None = None,
        /,
    ) -> None: ...


def _report(on_progress: Progress, row: Row | Sequence) -> None:
    """Tell `on_progress` an unfinished row's tokens so far (`Progress`)."""
    sampling, request_id = row.request.sampling, row.request.request_id
    if sampling.top_logprobs or sampling.prompt_logprobs:
        on_progress(request_id, row.response, row.logprobs, result_fields(row))
    else:
        on_progress(request_id, row.response, row.logprobs)


def _runs(request: GenerateRequest) -> bool:
    """Whether the request needs the model: tokens to make, or its prompt's logprobs."""
    return request.sampling.max_new_tokens > 0 or request.sampling.prompt_logprobs


class TorchRolloutEngine:
    """A `miles.core.contracts.backends.RolloutEngine` running a Hugging Face causal LM in-process.

    Pausing: `pause()` makes a running `generate` stop at its next step and yield every unfinished
    request (queued ones included) with finish_reason "abort" and the tokens made so far; a new
    `generate` while paused raises RuntimeError. `load_weights` and `release_memory` wait for the
    step in progress, so they are safe to call from another thread after `pause()`.

    `release_memory` moves the weights to CPU and empties the CUDA cache; on a CPU engine there
    is nothing to free and it only marks the engine released. `generate` refuses while released.

    Weight sync goes through a `WeightReceiver`: it decodes a quantized `precision` the engine
    has no kernel for, and with `lora` (sync: adapters) applies the adapters that arrive.
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 64,
        seed: int = 0,
        record_routing: ReplayMode = "off",
        precision: Precision | None = None,
        lora: LoRAConfig | None = None,
        sync_timeout_s: float = 600.0,
        path: EnginePath = "hf",
        paged: TorchEngineConfig | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model_path = model_path
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.model, self._tokenizer = load_model(model_path, self.device, resolve_dtype(dtype))
        self._eos_ids = eos_token_ids(self.model, self._tokenizer)
        self._stops = StopChecker(self._eos_ids, self._tokenizer)
        # Constraints' bitmasks cover the tokenizer's ids; a padded vocabulary's extra logits
        # are never allowed.
        self.constraint_vocab_size = len(self._tokenizer)
        # Set before the weight receiver, which may load (convert) weights right away.
        self._paged: PagedRunner | None = None
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._weight_version = 0
        self._paused = False
        self._released = False
        self._lock = threading.Lock()  # one model step, weight load or offload at a time
        self._adapters: AdapterApplier | None = None  # LoRA adapters on the loaded base
        self._receiver = WeightReceiver(
            model_path=model_path,
            dtype=self.model.dtype,
            device=self.device,
            load=self.load_weights,
            apply_adapters=self.apply_adapters,
            precision=precision,
            lora=lora,
            timeout_s=sync_timeout_s,
        )
        experts = getattr(self.model.config, "num_experts", None) or getattr(
            self.model.config, "num_local_experts", None
        )
        self._routing_dtype = index_dtype(int(experts or 1))
        mode, why = batching_mode(DynamicCache(config=self.model.config))
        self._hf = HFLoop(
            self.model,
            max_batch_size=max_batch_size,
            padded=mode == "padded",
            generator=self._generator,
            finish_reason=self._finish_reason,
            pad_id=self._tokenizer.pad_token_id or 0,
            cache_kwarg=cache_kwarg(self.model),
            routing_dtype=self._routing_dtype,
            constraint_vocab=self.constraint_vocab_size,
            weight_version=lambda: self._weight_version,
        )
        # Either path records routes only for a model whose family knows its routers.
        adapter = router_adapter(self.model, f"record_routing={record_routing!r}")
        self.path, path_why = choose_path(path, self.device, self.model)
        if self.path == "paged":
            settings = paged or TorchEngineConfig(max_batch_size=max_batch_size)
            self._paged = PagedRunner(
                self.model,
                settings,
                self._generator,
                self._finish_reason,
                record_routing=record_routing,
                routing_dtype=self._routing_dtype,
                constraint_vocab=self.constraint_vocab_size,
            )
            mode, why = "paged", "pages, packed prefill, paged attention"
        elif record_routing != "off":
            assert adapter is not None  # router_adapter raises unless the setting is 'off'
            with_weights = record_routing == "ids+weights"
            self._hf.recorder = RoutingRecorder(self.model, adapter, with_weights=with_weights)
        log = structlog.get_logger(__name__)
        log.info("torch engine path", path=self.path, reason=path_why, model=model_path)
        log.info("torch engine batching", mode=mode, reason=why, model=model_path)

    @property
    def weight_version(self) -> int:
        return self._weight_version

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def generate(
        self, requests: list[GenerateRequest], on_progress: Progress | None = None
    ) -> Iterator[list[GenerateResult]]:
        """Stream the results of the requests as they finish, those finished by the same model
        step together (one message each, not one per request); argument checks run now, not
        lazily. `results` streams them one by one. `on_progress(request_id, response_ids,
        logprobs[, extras])` sees each unfinished request's tokens so far after every model step
        (`Progress`: the lists are the engine's own, copy what you keep).

        Beyond plain sampling a request may ask for (`SamplingParams`): ignore_eos, penalties,
        stop_regex, top_logprobs (at most `stops.MAX_TOP_LOGPROBS`), prompt_logprobs (raw, at
        temperature 1; with max_new_tokens 0 the model runs for them alone) and a constraint:
        see `logits` and `stops`. Penalties and constraints change the distribution sampled
        from, and so the logprobs returned."""
        if self._paused:
            raise RuntimeError("engine is paused: call resume() before generate()")
        if self._released:
            raise RuntimeError("engine memory is released: call resume_memory() before generate()")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id}: empty prompt")
            if r.sampling.max_new_tokens < 0:
                raise ValueError(f"request {r.request_id}: max_new_tokens must be >= 0")
            check_request(r, getattr(self.model.config, "vocab_size", None))
        return self._run(list(requests), on_progress)

    def results(self, requests: list[GenerateRequest]) -> Iterator[GenerateResult]:
        """`generate`, one result at a time."""
        return (result for finished in self.generate(requests) for result in finished)

    def _run(
        self, requests: list[GenerateRequest], on_progress: Progress | None
    ) -> Iterator[list[GenerateResult]]:
        if self._paged is not None:
            yield from self._run_paged(self._paged, requests, on_progress)
            return
        pending = deque(r for r in requests if _runs(r))
        empty = [self._hf.result(Row(r), "length") for r in requests if not _runs(r)]
        if empty:
            yield empty
        batches: list[Batch] = []  # padded: at most one; unpadded: one per admitted group
        while pending or batches:
            if self._paused or self._released:
                rows = [row for batch in batches for row in batch.rows if not row.done]
                rows += [Row(r) for r in pending]
                aborted = [self._hf.result(row, "abort") for row in rows]
                if aborted:
                    yield aborted
                return
            # Yield outside the lock and inference mode: the consumer runs while we are suspended.
            with self._lock, torch.inference_mode():
                batches, finished = self._step(batches, pending)
            if on_progress is not None:
                for row in (row for batch in batches for row in batch.rows if not row.done):
                    _report(on_progress, row)
            if finished:
                yield finished

    def _run_paged(
        self, runner: PagedRunner, requests: list[GenerateRequest], on_progress: Progress | None
    ) -> Iterator[list[GenerateResult]]:
        """The paged loop: this call's requests join the runner's shared schedule; any call's
        step advances every running request, and each call yields its own as they finish."""
        empty = [self._hf.result(Row(r), "length") for r in requests if not _runs(r)]
        if empty:
            yield empty
        with self._lock:
            pending = runner.add(r for r in requests if _runs(r))
        while pending:
            if self._paused or self._released:
                with self._lock:
                    runner.abort([s for s in pending if s.status is not Status.FINISHED])
                yield [self._paged_result(s) for s in pending]
                return
            with self._lock, torch.inference_mode():
                if not any(s.status is Status.FINISHED for s in pending):
                    runner.step()
            finished = [s for s in pending if s.status is Status.FINISHED]
            if on_progress is not None:
                for seq in pending:
                    if seq.status is not Status.FINISHED and seq.response:
                        _report(on_progress, seq)
            if finished:
                pending = [s for s in pending if s.status is not Status.FINISHED]
                yield [self._paged_result(s) for s in finished]

    def _finish_reason(self, row: Row | Sequence) -> str | None:
        """Both loops call this once per token appended to a response (`stops.StopChecker`:
        the row's constraint accepts the token; the reason the response ends, if it does)."""
        return self._stops(row)

    def _paged_result(self, seq: Sequence) -> GenerateResult:
        return GenerateResult(
            request_id=seq.request.request_id,
            response_ids=seq.response,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason or "abort",
            weight_version=self._weight_version,
            routing=seq.routing,
            routing_weights=seq.routing_weights,
            cached_tokens=seq.cached_tokens,
            **result_fields(seq),
        )

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None
    ) -> None:
        """Copy Hugging Face-named tensors into the model (see `loader.copy_weights`), then set
        the version (None: keep it, for one bucket of several); on a ValueError the version stays
        as it was."""
        with self._lock:
            copy_weights(self.model, named_tensors)
            if self._paged is not None:
                self._paged.weights_changed()
            if version is not None:
                self._weight_version = version

    def apply_adapters(
        self, adapters: Iterable[tuple[str, torch.Tensor]], scaling: float, version: int | None
    ) -> None:
        """`lora.sync: adapters`: weight = base + scaling * B @ A for each adapted module, from
        the base this engine loaded (kept aside the first time: one copy per adapted weight)."""
        with self._lock:
            if self._adapters is None:
                self._adapters = AdapterApplier(self.model, scaling)
            self._adapters.apply(adapters)
            if self._paged is not None:
                self._paged.weights_changed()
            if version is not None:
                self._weight_version = version

    def join_weight_sync(self, host: str, port: int, world_size: int, rank: int) -> None:
        self._receiver.join(host, port, world_size, rank)

    def leave_weight_sync(self) -> None:
        self._receiver.close()

    def receive_weights(self, plan: SyncPlan, version: int) -> None:
        self._receiver.receive(plan, version)

    def load_bucket(self, plan: SyncPlan, index: int, handle: Any) -> None:
        self._receiver.load_bucket(plan, index, handle)

    def set_weight_version(self, version: int) -> None:
        """Ends a sync (an in-place one applies its adapters now) at `version`."""
        self._receiver.finish()
        with self._lock:
            self._weight_version = version

    def weights_checksum(self) -> str:
        with self._lock:
            return tensors_checksum(named_state(self.model))

    def get_rng_state(self) -> str:
        """The sampling generator's state as base64 text, for a checkpoint: restoring it with
        `set_rng_state` makes the engine sample exactly what it would have sampled next."""
        with self._lock:
            return base64.b64encode(self._generator.get_state().numpy().tobytes()).decode("ascii")

    def set_rng_state(self, state: str) -> None:
        """Restore a state from `get_rng_state`; ValueError if it is not one for this device."""
        try:
            raw = base64.b64decode(state.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError, AttributeError) as e:
            raise ValueError(f"engine RNG state is not valid base64: {e}") from e
        with self._lock:
            expected = self._generator.get_state().numel()
            if len(raw) != expected:
                raise ValueError(
                    f"engine RNG state has {len(raw)} bytes; a {self.device.type} generator "
                    f"state has {expected}"
                )
            state_tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            try:
                self._generator.set_state(state_tensor)
            except RuntimeError as e:
                raise ValueError(f"engine RNG state rejected by torch: {e}") from e

    def pause(self) -> None:
        self._paused = True

    def resume(self) -> None:
        self._paused = False

    def release_memory(self) -> None:
        with self._lock:
            if self.device.type == "cuda" and not self._released:
                if self._paged is not None:
                    self._paged.release()
                self.model.to("cpu")
                torch.cuda.empty_cache()
            self._released = True

    def resume_memory(self) -> None:
        with self._lock:
            if self.device.type == "cuda" and self._released:
                self.model.to(self.device)
                if self._paged is not None:
                    self._paged.restore()
            self._released = False

    def _step(
        self, batches: list[Batch], pending: deque[GenerateRequest]
    ) -> tuple[list[Batch], list[GenerateResult]]:
        """One step of the hf loop: the seam a subclass wraps (the chaos tests' slow engine)."""
        return self._hf.step(batches, pending)

    def health(self) -> dict[str, Any]:
        health = {
            "ok": True,
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "weight_version": self._weight_version,
            "model": self.model_path,
            "paused": self._paused,
            "released": self._released,
            "path": self.path,
        }
        if self._paged is not None:
            health["prefix_hit_rate"] = self._paged.prefix_hit_rate
            health["kv_cache_tokens"] = self._paged.kv_cache_tokens
        if self._receiver.report is not None:
            health["weights_format"] = self._receiver.report
        return health
