"""Batches generate requests from many concurrent rollout functions onto the engines.

Rollout functions call `generate` one group at a time. Requests that arrive in the same event-loop
tick are flushed together, split evenly over the engines, and streamed back: each awaiting caller
resumes as soon as its own results are in, not when the whole batch is done.
"""

from __future__ import annotations

import asyncio
from typing import Any

from miles.core.telemetry import carrier
from miles.core.types import GenerateRequest, GenerateResult


class EngineDispatcher:
    def __init__(self, engines: list[Any]) -> None:
        self.engines = engines
        self._pending: list[tuple[GenerateRequest, asyncio.Future[GenerateResult]]] = []
        self._flush_scheduled = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        self._pending.extend(zip(requests, futures, strict=True))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return list(await asyncio.gather(*futures))

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        shares = [pending[i :: len(self.engines)] for i in range(len(self.engines))]
        trace = carrier()
        for engine, share in zip(self.engines, shares, strict=True):
            if share:
                task = asyncio.ensure_future(self._run(engine, share, trace))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def _run(
        self,
        engine: Any,
        share: list[tuple[GenerateRequest, asyncio.Future[GenerateResult]]],
        trace: dict[str, str],
    ) -> None:
        by_id = {req.request_id: fut for req, fut in share}
        try:
            stream = engine.generate.options(num_returns="streaming").remote(
                [req for req, _ in share], trace
            )
            async for ref in stream:
                result: GenerateResult = await ref
                by_id.pop(result.request_id).set_result(result)
            if by_id:
                raise RuntimeError(f"engine returned no result for requests {sorted(by_id)}")
        except Exception as exc:
            for fut in by_id.values():
                if not fut.done():
                    fut.set_exception(exc)
