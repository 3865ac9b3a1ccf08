"""Stand-ins for Ray actor handles, so the runtime's logic runs in one event loop, without Ray.

A fake method's `.remote(...)` runs the plain method and returns an awaitable, as an ObjectRef
is awaitable; `generate.options(num_returns="streaming").remote(...)` returns an async stream of
such awaitables, as Ray's streaming generators do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from miles.core.contracts.types import GenerateRequest, GenerateResult


class _Remote:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        async def call() -> Any:
            result = self.fn(*args, **kwargs)
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.ensure_future(call())

    def options(self, **_: Any) -> _Remote:
        return self


class FakeHandle:
    """`handle.method.remote(...)` for every public method of `target`."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Remote:
        return _Remote(getattr(self._target, name))


HANG = "hang"


class _Stream:
    """Each item: a list of results finished together (streamed as an awaitable), an exception
    (raised), or HANG."""

    def __init__(self, items: list[Any]) -> None:
        self._items = items

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        await asyncio.sleep(0)
        if not self._items:
            raise StopAsyncIteration
        item = self._items.pop(0)
        if isinstance(item, BaseException):
            raise item
        if item == HANG:
            await asyncio.Event().wait()  # never set
        future: asyncio.Future[list[GenerateResult]] = asyncio.get_running_loop().create_future()
        future.set_result(item)
        return future


class FakeEngine:
    """An engine that answers each request with `tokens` tokens; `fail` makes its streams raise
    (an actor death) or hang after `after` results."""

    def __init__(self, tokens: int = 2, version: int = 0) -> None:
        self.tokens, self.version = tokens, version
        self.calls: list[list[int]] = []  # request ids of each generate call
        self.fail: BaseException | None = None
        self.hang = False
        self.after = 0
        self.paused = False
        self.health_calls = 0
        self.log: list[str] = []

    # generate, as the dispatcher calls it: handle.generate.options(...).remote(requests, trace)
    @property
    def generate(self) -> Any:
        engine = self

        class _Generate:
            def options(self, **_: Any) -> _Generate:
                return self

            def remote(self, requests: list[GenerateRequest], trace: Any) -> _Stream:
                engine.calls.append([r.request_id for r in requests])
                return _Stream(engine._items(requests))

        return _Generate()

    def _items(self, requests: list[GenerateRequest]) -> list[Any]:
        items: list[Any] = []
        for i, r in enumerate(requests):
            if i == self.after and self.fail is not None:
                return [*items, self.fail]
            if i == self.after and self.hang:
                return [*items, HANG]
            reason = "abort" if self.paused else "length"
            n = 0 if self.paused else min(self.tokens, r.sampling.max_new_tokens)
            ids = [r.request_id * 100 + len(r.prompt_ids) + k for k in range(n)]
            items.append([GenerateResult(r.request_id, ids, [-0.5] * n, reason, self.version)])
        return items

    def health(self) -> dict[str, Any]:
        self.health_calls += 1
        return {"ok": True, "paused": self.paused, "dtype": "float32"}

    def checksum(self) -> str:
        return f"weights-v{self.version}"

    def weight_version(self) -> int:
        return self.version

    def pause(self) -> None:
        self.log.append("pause")
        self.paused = True

    def resume(self) -> None:
        self.log.append("resume")
        self.paused = False

    def leave_weight_sync(self) -> None:
        self.log.append("leave")


def request(request_id: int, max_new_tokens: int = 4) -> GenerateRequest:
    from miles.core.contracts.types import SamplingParams

    return GenerateRequest(request_id, [1, 2, 3], SamplingParams(max_new_tokens=max_new_tokens))
