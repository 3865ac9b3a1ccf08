"""Batches generate requests from many concurrent rollout functions onto the ready engines.

Rollout functions call `generate` one group at a time. Requests that arrive in the same event-loop
tick are flushed together, each to the ready engine with the fewest requests in flight, and
streamed back: each awaiting caller resumes as soon as its own results are in, not when the whole
batch is done.

Which engines are ready is the engine group's call: it pushes `Routes` (the ready engines, whether
requests must wait for a weight update, a fatal error), and the dispatcher reports the engines it
sees fail. Every request is accounted for until its result is delivered:
- an engine that dies (actor error) or goes silent for `fault.request_timeout_s` is reported to
  the engine group (which kills and restarts it) and skipped from then on; its unfinished
  requests go back in the queue for the healthy engines;
- a request cut short by a weight update ("abort") goes back in the queue too, either to finish
  from where it stopped with the new weights (a partial rollout: each token keeps the version it
  was sampled with) or to start again from its prompt, as `async.on_weight_update` says.
While the queue is held (during a weight update, or with no ready engine) requests wait in it.
A request that is, after an engine call ends, neither delivered nor queued nor on another engine
was lost by this bookkeeping: its caller gets a `RequestLostError` naming it, never a wait forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, cast

import ray
from ray import ObjectRef
from ray.actor import ActorMethod
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from miles.core.contracts.backends import EngineUnavailable
from miles.core.contracts.types import GenerateRequest, GenerateResult, token_versions
from miles.core.observability.telemetry import carrier
from miles.runtime.actors.engine_pool import EngineFailedError

if TYPE_CHECKING:
    from miles.runtime.actors.engine_actor import EngineHandle


@dataclass(frozen=True)
class Route:
    """One ready engine: its slot, the slot's generation (bumped by each restart) and handle."""

    index: int
    generation: int
    handle: EngineHandle


@dataclass(frozen=True)
class Routes:
    """What the engine group tells the dispatcher. Pushes may arrive out of order (an async
    actor does not run calls in the order they were made): the highest `epoch` wins."""

    epoch: int = 0
    ready: tuple[Route, ...] = ()
    held: bool = False  # a weight update is under way: requests wait
    fatal: str | None = None  # an engine failed past its restart budget
    restarts: int = 0  # engine restarts so far, for the run's metrics
    dropped: int = 0  # engines dropped past their restart budget


# (engine index, generation, reason): the engine group's business from there.
FailureReport = Callable[[int, int, str], object]


class EngineSupervisor:
    """The actor the dispatcher's failure reports go to: the engine group, which kills and
    restarts the engine. A base class of `EngineGroup`, so that the rollout manager (which sends
    the reports) can name the engine group's handle, `ActorProxy[EngineSupervisor]`, without
    importing the engine group's module, which imports the rollout manager's."""

    @ray.method
    def engine_failed(self, index: int, generation: int, reason: str) -> None:
        # The signature only: EngineGroup overrides it, and no bare EngineSupervisor is made.
        raise NotImplementedError


class RequestLostError(RuntimeError):
    """A request the dispatcher holds nowhere any more (not delivered, queued or on an engine): a
    bug in its bookkeeping, raised to the caller instead of leaving it waiting forever."""


@dataclass(eq=False)  # compared by identity: the same request may be queued and on an engine
class _Pending:
    request: GenerateRequest  # as the rollout function made it
    future: asyncio.Future[GenerateResult]
    # The caller's trace context: a flush may run from another context (new routes arriving),
    # and the engine's spans still belong under the rollout that asked.
    trace: dict[str, str]
    # Tokens made before a weight update cut the request short (kept with on_weight_update:
    # continue), with their logprobs and weight versions.
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    on_engines: int = 0  # engine calls holding it now (one, or two while an abort is requeued)

    def next_request(self) -> GenerateRequest:
        """The original request, or its continuation after the tokens made so far."""
        if not self.tokens:
            return self.request
        left = self.request.sampling.max_new_tokens - len(self.tokens)
        return replace(
            self.request,
            prompt_ids=[*self.request.prompt_ids, *self.tokens],
            sampling=replace(self.request.sampling, max_new_tokens=max(left, 0)),
        )


class EngineDispatcher:
    def __init__(
        self,
        report_failure: FailureReport,
        *,
        request_timeout_s: float,
        on_weight_update: Literal["continue", "requeue"] = "continue",
    ) -> None:
        self.report_failure = report_failure
        self.request_timeout_s = request_timeout_s
        self.on_weight_update = on_weight_update
        self.routes = Routes()
        self._failed: set[tuple[int, int]] = set()  # (index, generation) seen failing here
        self._inflight: dict[int, int] = {}  # requests on each engine, by index
        self._queue: list[_Pending] = []
        self._flush_scheduled = False
        self._running: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.requeued = 0  # requests sent again after an engine failure or a weight update
        self._busy_since: float | None = None
        self.busy_s = 0.0  # wall time with at least one request on an engine
        # Prompt tokens sent, and those the engines found in their prefix caches.
        self.prompt_tokens = 0
        self.cached_tokens = 0

    # ── the rollout functions' side ──────────────────────────────────────────────────────────────

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        loop = asyncio.get_running_loop()
        trace = carrier()
        pending = [_Pending(r, loop.create_future(), trace) for r in requests]
        self._queue.extend(pending)
        self._schedule_flush()
        results = list(await asyncio.gather(*(p.future for p in pending)))
        self.prompt_tokens += sum(len(r.prompt_ids) for r in requests)
        self.cached_tokens += sum(r.cached_tokens for r in results)
        return results

    # ── the engine group's side ──────────────────────────────────────────────────────────────────

    def set_routes(self, routes: Routes) -> None:
        """The engines to use from now on (held: none until released); older ones are ignored."""
        if routes.epoch < self.routes.epoch:
            return
        self.routes = routes
        self._failed = {
            f for f in self._failed if any(f == (r.index, r.generation) for r in routes.ready)
        }
        self._schedule_flush()

    async def drained(self) -> None:
        """Until no request is on any engine (paused engines hand theirs back quickly)."""
        await self._idle.wait()

    def check(self) -> None:
        """Raises EngineFailedError once an engine is past its restart budget."""
        if self.routes.fatal is not None:
            raise EngineFailedError(self.routes.fatal)

    def inflight(self, index: int) -> int:
        return self._inflight.get(index, 0)

    def ready(self) -> list[Route]:
        return [r for r in self.routes.ready if (r.index, r.generation) not in self._failed]

    # ── placement on engines ─────────────────────────────────────────────────────────────────────

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        engines = self.ready()
        if self.routes.held or not engines or not self._queue:
            return
        queue, self._queue = self._queue, []
        # Least in flight first: each request goes to the engine with the fewest requests on it
        # (ties: the first ready one), so a batch spreads evenly and the one-at-a-time requests
        # of multi-turn and agent episodes do not pile onto one engine.
        load = [self.inflight(route.index) for route in engines]
        shares: list[list[_Pending]] = [[] for _ in engines]
        for pending in queue:
            target = load.index(min(load))
            shares[target].append(pending)
            load[target] += 1
        for route, share in zip(engines, shares, strict=True):
            if share:
                for pending in share:
                    pending.on_engines += 1
                self._start(self._run(route, share, share[0].trace))

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        self._idle.clear()
        if self._busy_since is None:
            self._busy_since = time.perf_counter()
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if not self._running:
            self._idle.set()
            if self._busy_since is not None:
                self.busy_s += time.perf_counter() - self._busy_since
                self._busy_since = None
        self._schedule_flush()

    async def _run(self, route: Route, share: list[_Pending], trace: dict[str, str]) -> None:
        by_id = {p.request.request_id: p for p in share}
        self._inflight[route.index] = self.inflight(route.index) + len(share)
        try:
            stream = _generate(route.handle, [p.next_request() for p in share], trace)
            loop = asyncio.get_running_loop()
            # One deadline for the whole stream, pushed back at every result: cheaper per result
            # than a wait_for (a task each), and a silent engine still times out.
            async with asyncio.timeout(self.request_timeout_s) as deadline:
                async for ref in stream:
                    finished: list[GenerateResult] = await ref
                    for result in finished:
                        self._deliver(by_id.pop(result.request_id), result)
                    deadline.reschedule(loop.time() + self.request_timeout_s)
                    if not by_id:
                        break
            if by_id:
                raise RuntimeError(f"engine returned no result for requests {sorted(by_id)}")
        except TimeoutError:
            self._engine_failed(
                route,
                f"hung: no result for {self.request_timeout_s:g}s inside generate "
                "(fault.request_timeout_s)",
                by_id,
            )
        except (ActorDiedError, ActorUnavailableError, RayActorError, EngineUnavailable) as exc:
            # The engine process died or became unreachable, or lost what it runs on.
            self._engine_failed(route, f"{type(exc).__name__}: {exc}", by_id)
        except Exception as exc:  # the engine refused the request itself: the caller's error
            for p in by_id.values():
                if not p.future.done():
                    p.future.set_exception(exc)
        finally:
            self._inflight[route.index] = max(self.inflight(route.index) - len(share), 0)
            for pending in share:
                pending.on_engines -= 1
            self._fail_lost(route, share)

    def _fail_lost(self, route: Route, share: list[_Pending]) -> None:
        """Every request of an engine call that ended is delivered, queued again or on another
        engine; one that is none of these would leave its caller waiting forever."""
        open_ = [p for p in share if not p.future.done() and p.on_engines == 0]
        if not open_:
            return
        queued = {id(p) for p in self._queue}
        lost = [p for p in open_ if id(p) not in queued]
        if not lost:
            return
        ids = sorted(p.request.request_id for p in lost)
        error = RequestLostError(
            f"requests {ids} were lost after their call to engine {route.index} ended: neither "
            "delivered nor queued again (a bug in the dispatcher; please report it)"
        )
        for pending in lost:
            pending.future.set_exception(error)

    def _engine_failed(self, route: Route, reason: str, unfinished: dict[int, _Pending]) -> None:
        key = (route.index, route.generation)
        if key not in self._failed:  # report each engine once; the group restarts it
            self._failed.add(key)
            self.report_failure(route.index, route.generation, reason)
        self.requeued += len(unfinished)
        self._queue.extend(unfinished.values())  # the flush when this call ends sends them

    def _deliver(self, pending: _Pending, result: GenerateResult) -> None:
        versions = token_versions(result.weight_version, len(result.response_ids))
        if result.finish_reason == "abort":
            # Cut short by a weight update: finish it later, from here or from its prompt.
            if self.on_weight_update == "continue":
                pending.tokens += result.response_ids
                pending.logprobs += result.logprobs
                pending.versions += versions
            else:
                pending.tokens, pending.logprobs, pending.versions = [], [], []
            self.requeued += 1
            self._queue.append(pending)
            return
        if pending.tokens:
            result = replace(
                result,
                response_ids=[*pending.tokens, *result.response_ids],
                logprobs=[*pending.logprobs, *result.logprobs],
                weight_version=[*pending.versions, *versions],
            )
        if not pending.future.done():
            pending.future.set_result(result)


def _generate(
    engine: EngineHandle, requests: list[GenerateRequest], trace: dict[str, str]
) -> AsyncIterator[ObjectRef[list[GenerateResult]]]:
    """`EngineActor.generate` as a Ray streaming generator: a ref for each list of results that
    finished together. Ray's typing has no `.options(...)`: mypy checks the arguments through
    the plain call under TYPE_CHECKING, and the streaming call is cast."""
    if TYPE_CHECKING:
        engine.generate.remote(requests, trace)
    method = cast(ActorMethod, engine.generate)
    stream: AsyncIterator[ObjectRef[list[GenerateResult]]] = method.options(
        num_returns="streaming"
    ).remote(requests, trace)
    return stream
