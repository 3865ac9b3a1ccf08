"""`TorchRolloutEngine`: a plain PyTorch + transformers rollout engine with continuous batching.

Each step either prefills newly admitted prompts (left-padded, one forward) or runs one decode
step over every row. A row's result is yielded as soon as it finishes; finished rows are dropped
in bulk and their slots go to waiting prompts, so long generations do not hold short ones back.
Sampling and logprobs live in `sampler`, the cache bookkeeping in `batch`.

Models whose cache cannot be left-padded (sliding windows, compressed-window attention: see
`batch.batching_mode`) run unpadded instead: prompts of equal length are admitted together as
one batch, and each such batch decodes with its own forward.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import structlog
import torch
from transformers import DynamicCache

from miles.core.backends import Precision
from miles.core.config import LoRAConfig, ReplayMode
from miles.core.types import GenerateRequest, GenerateResult
from miles.core.weight_sync import SyncPlan
from miles.precision.lora import AdapterApplier
from miles.torch.engine.batch import Batch, Row, batching_mode
from miles.torch.engine.config import EnginePath, TorchEngineConfig
from miles.torch.engine.loader import (
    cache_kwarg,
    copy_weights,
    eos_token_ids,
    load_model,
    resolve_dtype,
)
from miles.torch.engine.paged.runner import PagedRunner
from miles.torch.engine.paged.sequence import Sequence, Status
from miles.torch.engine.path import choose_path
from miles.torch.engine.sampler import SamplingTensors, sample
from miles.torch.routing import RoutingRecorder, index_dtype, router_adapter
from miles.torch.sync.checksum import tensors_checksum
from miles.torch.sync.receiver import WeightReceiver
from miles.torch.weights import named_state

# (request id, response ids so far, their logprobs): a request's progress after a model step.
Progress = Callable[[int, list[int], list[float]], None]


def _rows(weights: torch.Tensor | None, i: int, width: int, n: int) -> torch.Tensor | None:
    if weights is None:
        return None
    return weights.view(-1, width, *weights.shape[1:])[i, width - n :]


class TorchRolloutEngine:
    """A `miles.core.protocols.RolloutEngine` running a Hugging Face causal LM in-process.

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
        # Set before the weight receiver, which may load (convert) weights right away.
        self._paged: PagedRunner | None = None
        self._cache_kwarg = cache_kwarg(self.model)
        self._pad_id = self._tokenizer.pad_token_id or 0
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._weight_version = 0
        self._paused = False
        self._released = False
        self._lock = threading.Lock()  # one model step, weight load or offload at a time
        self._recorder: RoutingRecorder | None = None  # hf path only: hooks on the routers
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
        self._padded = mode == "padded"
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
            )
            mode, why = "paged", "pages, packed prefill, paged attention"
        elif record_routing != "off":
            assert adapter is not None  # router_adapter raises unless the setting is 'off'
            with_weights = record_routing == "ids+weights"
            self._recorder = RoutingRecorder(self.model, adapter, with_weights=with_weights)
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
        logprobs)` sees each unfinished request's tokens so far after every model step (the
        lists are the engine's own: copy what you keep)."""
        if self._paused:
            raise RuntimeError("engine is paused: call resume() before generate()")
        if self._released:
            raise RuntimeError("engine memory is released: call resume_memory() before generate()")
        for r in requests:
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id}: empty prompt")
            if r.sampling.max_new_tokens < 0:
                raise ValueError(f"request {r.request_id}: max_new_tokens must be >= 0")
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
        pending = deque(r for r in requests if r.sampling.max_new_tokens > 0)
        empty = [self._result(Row(r), "length") for r in requests if not r.sampling.max_new_tokens]
        if empty:
            yield empty
        batches: list[Batch] = []  # padded: at most one; unpadded: one per admitted group
        while pending or batches:
            if self._paused or self._released:
                rows = [row for batch in batches for row in batch.rows if not row.done]
                rows += [Row(r) for r in pending]
                aborted = [self._result(row, "abort") for row in rows]
                if aborted:
                    yield aborted
                return
            # Yield outside the lock and inference mode: the consumer runs while we are suspended.
            with self._lock, torch.inference_mode():
                batches, finished = self._step(batches, pending)
            if on_progress is not None:
                for row in (row for batch in batches for row in batch.rows if not row.done):
                    on_progress(row.request.request_id, row.response, row.logprobs)
            if finished:
                yield finished

    def _run_paged(
        self, runner: PagedRunner, requests: list[GenerateRequest], on_progress: Progress | None
    ) -> Iterator[list[GenerateResult]]:
        """The paged loop: this call's requests join the runner's shared schedule; any call's
        step advances every running request, and each call yields its own as they finish."""
        empty = [self._result(Row(r), "length") for r in requests if not r.sampling.max_new_tokens]
        if empty:
            yield empty
        with self._lock:
            pending = runner.add(r for r in requests if r.sampling.max_new_tokens > 0)
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
                        on_progress(seq.request.request_id, seq.response, seq.logprobs)
            if finished:
                pending = [s for s in pending if s.status is not Status.FINISHED]
                yield [self._paged_result(s) for s in finished]

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
        )

    def _step(
        self, batches: list[Batch], pending: deque[GenerateRequest]
    ) -> tuple[list[Batch], list[GenerateResult]]:
        """Prefill newly admitted prompts if there is room, else decode one token for every row."""
        free = self.max_batch_size - sum(len(batch) for batch in batches)
        if pending and free > 0:
            step, logits = self._prefill(self._admit(pending, free))
            finished = self._advance(step, logits)
            step.compact()  # a fresh prefill batch is small: compact now
            if len(step):
                if self._padded and batches:
                    batches[0].merge(step)
                else:
                    batches.append(step)
            return batches, finished
        finished = []
        for batch in batches:
            finished += self._advance(batch, self._decode(batch))
            # Dropping rows copies the whole cache, so finished rows ride along (their tokens
            # ignored) until a quarter of the batch is done; then one copy drops them all and
            # the freed slots are refilled in one prefill.
            if 4 * batch.num_done >= len(batch):
                batch.compact()
        return [batch for batch in batches if len(batch)], finished

    def _admit(self, pending: deque[GenerateRequest], free: int) -> list[GenerateRequest]:
        """The next prompts to prefill together: the first `free` (unpadded: the first `free` of
        the head's prompt length, so that the batch needs no padding)."""
        if self._padded:
            return [pending.popleft() for _ in range(min(free, len(pending)))]
        n = len(pending[0].prompt_ids)
        taken = [r for r in pending if len(r.prompt_ids) == n][:free]
        chosen = {id(r) for r in taken}
        rest = [r for r in pending if id(r) not in chosen]
        pending.clear()
        pending.extend(rest)
        return taken

    def _advance(self, step: Batch, logits: torch.Tensor) -> list[GenerateResult]:
        """Sample each row's next token from `logits`; the results of the rows that finish."""
        counters = None
        if step.params.seeded:
            lengths = [len(row.response) for row in step.rows]
            counters = torch.tensor(lengths, device=self.device)
        step.last_tokens, logprobs = sample(logits, step.params, self._generator, counters)
        finished = []
        for row, token, logprob in zip(
            step.rows, step.last_tokens.tolist(), logprobs.tolist(), strict=True
        ):
            if row.done:
                continue
            row.response.append(token)
            row.logprobs.append(logprob)
            reason = self._finish_reason(row)
            if reason is not None:
                row.done = True
                finished.append(self._result(row, reason))
        return finished

    def _prefill(self, requests: list[GenerateRequest]) -> tuple[Batch, torch.Tensor]:
        """Run the prompts through the model as one left-padded batch; last-position logits."""
        width = max(len(r.prompt_ids) for r in requests)
        row_records: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        ids = torch.full((len(requests), width), self._pad_id, dtype=torch.int64)
        mask = torch.zeros((len(requests), width), dtype=torch.int64)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        # Real tokens get positions 0..n-1 whatever their padding; pads get 0 (they are masked).
        position_ids = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        if self._recorder is not None:  # every prompt token's experts (left padding dropped)
            indices, weights = self._recorder.take()
            indices = indices.view(len(requests), width, *indices.shape[1:])
            for i, r in enumerate(requests):
                n = len(r.prompt_ids)
                row_records.append((indices[i, width - n :], _rows(weights, i, width, n)))
        rows = [Row(r) for r in requests]
        for row, (idx, w) in zip(rows, row_records, strict=False):
            row.routing.append(idx)
            if w is not None:
                row.routing_weights.append(w)
        batch = Batch(
            rows=rows,
            cache=cache,
            mask=mask,
            positions=mask.sum(dim=1),
            last_tokens=ids[:, -1],
            params=SamplingTensors.from_params([r.sampling for r in requests], self.device),
            padded=self._padded,
        )
        return batch, out.logits[:, -1]

    def _decode(self, batch: Batch) -> torch.Tensor:
        """Feed each row its last sampled token; next-token logits [rows, vocab]."""
        ones = torch.ones((len(batch), 1), dtype=batch.mask.dtype, device=self.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        out = self.model(
            input_ids=batch.last_tokens.unsqueeze(1),
            attention_mask=batch.mask,
            position_ids=batch.positions.unsqueeze(1),
            use_cache=True,
            **{self._cache_kwarg: batch.cache},
        )
        if self._recorder is not None:  # each row's newest token
            indices, weights = self._recorder.take()
            for i, row in enumerate(batch.rows):
                row.routing.append(indices[i : i + 1])
                if weights is not None:
                    row.routing_weights.append(weights[i : i + 1])
        batch.positions = batch.positions + 1
        logits: torch.Tensor = out.logits[:, -1]
        return logits

    def _finish_reason(self, row: Row | Sequence) -> str | None:
        sampling = row.request.sampling
        token = row.response[-1]
        if token in self._eos_ids or token in sampling.stop_token_ids:
            return "stop"
        if sampling.stop_strings and self._hits_stop_string(row.response, sampling.stop_strings):
            return "stop"
        if len(row.response) >= sampling.max_new_tokens:
            return "length"
        return None

    def _hits_stop_string(self, response: list[int], stop_strings: tuple[str, ...]) -> bool:
        # A new match must end in the newest token. Every token decodes to at least one byte, so a
        # match of n bytes lies within the last n + 1 tokens (+1 for a token it starts inside).
        window = max(len(s.encode()) for s in stop_strings) + 2
        tail = self._tokenizer.decode(response[-window:])
        return any(s in tail for s in stop_strings)

    def _result(self, row: Row, reason: str) -> GenerateResult:
        routing = weights = None
        if self._recorder is not None and row.routing:
            # The last sampled token was never fed through the model: its row stays -1.
            n = len(row.request.prompt_ids) + len(row.response)
            routing = np.full((n, *row.routing[0].shape[1:]), -1, dtype=self._routing_dtype)
            fed = torch.cat(row.routing).cpu().numpy()
            routing[: len(fed)] = fed[:n]
            if row.routing_weights:
                weights = np.zeros(routing.shape, dtype=np.float32)
                fed_w = torch.cat(row.routing_weights).cpu().numpy()
                weights[: len(fed_w)] = fed_w[:n]
        return GenerateResult(
            request_id=row.request.request_id,
            response_ids=row.response,
            logprobs=row.logprobs,
            finish_reason=reason,
            weight_version=self._weight_version,
            routing=routing,
            routing_weights=weights,
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
        if self._receiver.report is not None:
            health["weights_format"] = self._receiver.report
        return health
