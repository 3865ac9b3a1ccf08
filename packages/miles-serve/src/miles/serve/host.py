"""The engine behind `miles serve`: requests from many HTTP calls batched into engine calls, and
SGLang's pause / continue / abort semantics on top of the engine's one `pause()`.

A bounded queue takes each prompt; a batcher thread gathers what is queued (up to the engine's
batch size) into one `engine.generate` call, run on a worker thread, so concurrent clients share
model steps. Each prompt's result is delivered through its callback on the thread that finished
it.

The engine can only stop everything it runs (`pause()`: every running request comes back with
finish "abort" and its tokens so far). The host builds SGLang's modes from that:
- `abort`: the stopped requests are answered with finish_reason abort;
- `retract` / `in_place`: they are kept and, on `continue_generation`, resumed from where they
  stopped (prompt + tokens so far, the rest of the token budget); their answer joins both parts
  (tokens, logprobs) and carries the weight version that finished it;
- `/abort_request` of one request: everything is stopped, that one answered with abort, the rest
  resumed at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from miles.core.contracts.types import GenerateRequest, GenerateResult, SamplingParams

Deliver = Callable[["Finished"], None]
# A streamed prompt's response so far (ids, logprobs), after each model step, and the
# `Finished` fields top_logprobs, prompt_logprobs and prompt_top_logprobs so far (None: not asked).
OnTokens = Callable[[list[int], list[float], dict[str, Any]], None]


class QueueFull(RuntimeError):
    """More prompts wait than the server's queue holds (HTTP 503)."""


class NotServing(RuntimeError):
    """Paused, or memory released (HTTP 503)."""


@dataclass
class Finished:
    """A prompt's whole answer, its parts joined when it was retracted and resumed."""

    rid: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # stop | length | abort
    weight_version: int
    routing: Any = None  # [tokens, layers, top_k] of prompt + response, or None
    cached_tokens: int = 0
    started: float = 0.0
    error: str | None = None  # the engine failed on this request
    # With SamplingParams.top_logprobs / prompt_logprobs (GenerateResult's fields).
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class _Job:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    deliver: Deliver
    on_tokens: OnTokens | None = None  # streamed: told the tokens so far after each step
    cache_salt: str | None = None
    started: float = field(default_factory=time.perf_counter)
    # Tokens made before a retraction; the next engine call continues after them.
    done_ids: list[int] = field(default_factory=list)
    done_logprobs: list[float] = field(default_factory=list)
    routing_so_far: Any = None  # the last part's record: prompt and every token before it
    done_top: list[list[tuple[int, float]]] = field(default_factory=list)
    # The first part's prompt logprobs (a resumed part's prompt includes earlier tokens).
    first_part: GenerateResult | None = None


class EngineHost:
    def __init__(self, engine: Any, max_batch_size: int = 64, max_queue: int = 1024) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        # Engine calls at once. The paged engine merges concurrent calls into one schedule, so a
        # request joins the running ones at the next step, as in SGLang's scheduler (with 4
        # calls, arrivals waited in the queue until a call ended: half of a batch had no token
        # when a weight update came). The hf path batches within a call only, so there one call
        # runs and the next takes everything that queued meanwhile.
        paged = getattr(engine, "path", "hf") == "paged"
        self._slots = threading.Semaphore(max_batch_size if paged else 1)
        self._queue: queue.Queue[_Job] = queue.Queue(maxsize=max_queue)
        self._ids = itertools.count()
        self._lock = threading.Condition()
        # Held by the batcher while it takes jobs from the queue and starts or holds them: a
        # pause waits for it, so a job taken before the pause is never started after it.
        self._taking = threading.Lock()
        self._running: dict[int, _Job] = {}  # engine request id -> job, in an engine call
        self._workers = 0  # engine calls in progress
        self._held: list[_Job] = []  # retracted, waiting for continue
        self._keep_stopped = False  # stopped jobs are held (retract) rather than answered
        self._drop: set[str] = set()  # rids to answer with abort when they stop
        self.paused = False
        self._closed = False
        self._batcher = threading.Thread(target=self._batch_loop, name="miles-serve-batcher")
        self._batcher.daemon = True
        self._batcher.start()

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        deliver: Deliver,
        on_tokens: OnTokens | None = None,
        cache_salt: str | None = None,
    ) -> None:
        # While paused a new request waits in the queue for continue_generation, as SGLang's
        # tokenizer manager holds it: a rollout client never sees the pause of a weight update.
        try:
            job = _Job(rid, list(prompt_ids), sampling, deliver, on_tokens, cache_salt)
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFull(
                f"{self._queue.maxsize} requests are queued already (--max-queue); retry later"
            ) from None

    @property
    def busy(self) -> bool:
        with self._lock:
            running = self._workers or self._running or self._held
            return bool(running) or not self._queue.empty()

    def _batch_loop(self) -> None:
        """Start engine calls while not paused: retracted requests first, then the queue."""
        while not self._closed:
            with self._lock:
                while self.paused and not self._closed:
                    self._lock.wait(timeout=0.1)
            if not self._slots.acquire(timeout=0.1):
                continue
            with self._taking:
                self._take_and_start()

    def _take_and_start(self) -> None:
        with self._lock:
            if self.paused:  # checked again under _taking: nothing is taken after a pause
                self._slots.release()
                return
            jobs = self._held[: self.max_batch_size]
            del self._held[: len(jobs)]
        if not jobs:
            try:
                jobs.append(self._queue.get(timeout=0.1))
            except queue.Empty:
                self._slots.release()
                return
            time.sleep(0.002)  # let a burst of concurrent requests arrive together
        while len(jobs) < self.max_batch_size:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self._start(jobs)

    def _start(self, jobs: list[_Job]) -> None:
        """One engine call on a worker thread, holding a slot until it ends. Paused meanwhile
        (in any mode): the jobs are kept for continue, as a request sent during a pause is;
        abort answers only what ran or was queued when the pause came (see `pause`)."""
        with self._lock:
            if self.paused:
                self._held[:0], jobs = jobs, []  # nothing generated yet: first on continue
        if not jobs:
            self._slots.release()
            return
        with self._lock:
            requests = []
            for job in jobs:
                request_id = next(self._ids)
                self._running[request_id] = job
                budget = job.sampling.max_new_tokens - len(job.done_ids)
                requests.append(
                    GenerateRequest(
                        request_id,
                        job.prompt_ids + job.done_ids,
                        _with_budget(job.sampling, budget),
                        job.cache_salt,
                    )
                )
            self._workers += 1
        thread = threading.Thread(target=self._work, args=(requests,), daemon=True)
        thread.start()

    def _work(self, requests: list[GenerateRequest]) -> None:
        with self._lock:
            streamed = any(self._running[r.request_id].on_tokens for r in requests)
        try:
            progress = {"on_progress": self._progress} if streamed else {}
            for finished in self.engine.generate(requests, **progress):
                for result in finished:
                    self._finish(result)
        except Exception as exc:
            for request in requests:
                with self._lock:
                    job = self._running.pop(request.request_id, None)
                    if job is None:
                        continue
                    if self.paused and self._keep_stopped and job.rid not in self._drop:
                        self._held.append(job)  # nothing generated yet: resumed on continue
                        continue
                error = None if self.paused else str(exc)
                job.deliver(self._answer(job, None, "abort", error=error))
        finally:
            with self._lock:
                self._workers -= 1
                self._lock.notify_all()
            self._slots.release()

    def _progress(
        self,
        request_id: int,
        response_ids: list[int],
        logprobs: list[float],
        extras: dict[str, Any] | None = None,
    ) -> None:
        """After a model step (on the engine's thread): a streamed prompt's tokens so far,
        joined to what it made before a retraction (its top and prompt logprobs too)."""
        job = self._running.get(request_id)
        if job is None or job.on_tokens is None:
            return
        extras, first = extras or {}, job.first_part  # first: the part before a retraction
        top = extras.get("top_logprobs")
        prompt = {k: extras.get(k) for k in ("prompt_logprobs", "prompt_top_logprobs")}
        if first is not None:  # a resumed part's prompt holds the earlier tokens
            prompt = {k: getattr(first, k) for k in prompt}
        job.on_tokens(
            job.done_ids + response_ids,
            job.done_logprobs + logprobs,
            {"top_logprobs": None if top is None else job.done_top + top, **prompt},
        )

    def _finish(self, result: GenerateResult) -> None:
        with self._lock:
            job = self._running.pop(result.request_id)
            if result.finish_reason == "abort" and job.rid not in self._drop and self._keep_stopped:
                job.done_ids += result.response_ids
                job.done_logprobs += result.logprobs
                job.done_top += result.top_logprobs or []
                job.first_part = job.first_part or result
                if result.routing is not None:
                    job.routing_so_far = result.routing
                self._held.append(job)
                return
            self._drop.discard(job.rid)
        job.deliver(self._answer(job, result, result.finish_reason))

    def _answer(
        self, job: _Job, result: GenerateResult | None, reason: str, error: str | None = None
    ) -> Finished:
        version = self.engine.weight_version
        first = job.first_part or result
        if result is not None:
            v = result.weight_version
            version = v if isinstance(v, int) else max(v, default=version)
        return Finished(
            rid=job.rid,
            prompt_ids=job.prompt_ids,
            response_ids=job.done_ids + (result.response_ids if result else []),
            logprobs=job.done_logprobs + (result.logprobs if result else []),
            finish_reason=reason,
            weight_version=version,
            # A resumed part's record covers prompt + earlier tokens + its own: the whole.
            routing=result.routing if result is not None else job.routing_so_far,
            cached_tokens=result.cached_tokens if result else 0,
            started=job.started,
            error=error,
            top_logprobs=(
                job.done_top + (result.top_logprobs or [] if result else [])
                if job.sampling.top_logprobs
                else None
            ),
            prompt_logprobs=first.prompt_logprobs if first else None,
            prompt_top_logprobs=first.prompt_top_logprobs if first else None,
        )

    # -- control -------------------------------------------------------------------------------

    def _stop_running(self, keep: bool) -> None:
        """Stop every engine call; wait until each has returned its requests."""
        with self._lock:
            self._keep_stopped = keep
            self.paused = True
        with self._taking:  # a batch being taken now is started or held before we go on
            pass
        self.engine.pause()
        with self._lock:
            while self._workers:
                self._lock.wait()

    def pause(self, mode: str) -> None:
        """SGLang's pause_generation: `abort` answers running and queued requests with abort;
        `retract` and `in_place` keep them for continue."""
        self._stop_running(keep=mode != "abort")
        if mode == "abort":  # everything taken in before the pause: running, held or queued
            with self._lock:
                held, self._held = self._held, []
            for job in [*held, *self._drain()]:
                job.deliver(self._answer(job, None, "abort"))

    def _drain(self) -> list[_Job]:
        jobs = []
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                return jobs

    def resume(self) -> None:
        """continue_generation: the engine runs again; the batcher starts retracted requests
        before anything queued. Returns at once, as SGLang's does."""
        self.engine.resume()
        with self._lock:  # together: a batch started meanwhile is held, never aborted
            self._keep_stopped = False
            self.paused = False
            self._lock.notify_all()

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """abort_request: answers the named request (or every one) with abort. Returns how many
        were aborted."""
        was_paused = self.paused
        with self._lock:
            wanted = {j.rid for j in self._running.values()} | {j.rid for j in self._held}
            queued = self._drain()
            known = wanted | {j.rid for j in queued}
            targets = known if abort_all else {r for r in known if r == rid}
        count = 0
        for job in queued:  # not started: answered now, the rest queued again
            if job.rid in targets:
                job.deliver(self._answer(job, None, "abort"))
                count += 1
            else:
                self._queue.put(job)
        running = targets & {j.rid for j in self._running.values()}
        held_targets = [j for j in self._held if j.rid in targets]
        if running:
            with self._lock:
                self._drop |= running
            self._stop_running(keep=True)
            count += len(running)
        with self._lock:
            self._held = [j for j in self._held if j.rid not in targets]
        for job in held_targets:
            job.deliver(self._answer(job, None, "abort"))
            count += 1
        if running and not was_paused:
            self.resume()
        return count

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._lock.notify_all()
        self._batcher.join(timeout=5)


def _with_budget(sampling: SamplingParams, budget: int) -> SamplingParams:
    """The sampling of a request's next part: the rest of its token budget; a resumed part
    (whose prompt holds the tokens made so far) asks for no prompt logprobs again."""
    if budget == sampling.max_new_tokens:
        return sampling
    return dataclasses.replace(sampling, max_new_tokens=max(budget, 0), prompt_logprobs=False)
