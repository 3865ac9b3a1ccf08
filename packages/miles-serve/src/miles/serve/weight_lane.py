"""Weight operations (joining a weight-update group, loading weights, releasing memory) run one at
a time on a thread of their own, each under a deadline.

Why a lane of its own: these calls block on the network or the disk. Run on the web server's
shared thread pool, forty slow ones (a group whose trainer is gone) took every worker, and
nothing else was answered. Here at most one thread is ever held by them; a call that waits its
turn waits as a coroutine, and gives up with 503 when its deadline passes first.

A call past its deadline answers 504, naming what it waited for. Its thread cannot be stopped
from outside, so the lane stays taken until that thread returns: the operation is handed the
seconds left to it and passes them to what it blocks on (the TCP store, the process group), which
bounds that wait too. One that reaches the lane with too little time left does not start. The
thread is a daemon, so a stuck one never keeps the process from exiting.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


_LEAST_S = 1.0  # an operation reaching the lane with less time than this left does not start


class LaneBusy(Exception):
    """Another weight operation held the lane past this one's deadline (HTTP 503)."""


class DeadlineExceeded(Exception):
    """The operation did not finish within its deadline (HTTP 504)."""


class WeightLane:
    def __init__(self, deadline_s: float) -> None:
        if not deadline_s > 0:
            raise ValueError(f"the weight-operation deadline must be positive, got {deadline_s}")
        self.deadline_s = deadline_s
        self._turn = asyncio.Lock()
        self._running: tuple[str, float] | None = None  # (what, monotonic start)

    async def run(self, what: str, fn: Callable[[float], T]) -> T:
        """`fn(seconds_left)` on a thread of the lane's once the lane is free; its result, or
        LaneBusy / DeadlineExceeded when `deadline_s` (counted from now) passes first."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.deadline_s
        try:
            await asyncio.wait_for(self._turn.acquire(), self.deadline_s)
        except TimeoutError:
            raise self._busy(what) from None
        left = end - loop.time()
        if left < min(_LEAST_S, self.deadline_s / 2):
            error = self._busy(what)
            self._turn.release()
            raise error
        self._running = (what, time.monotonic())
        done: asyncio.Future[T] = loop.create_future()

        def work() -> None:
            try:
                result = fn(left)
            except BaseException as exc:  # handed to the waiting request
                loop.call_soon_threadsafe(_settle, done, None, exc)
            else:
                loop.call_soon_threadsafe(_settle, done, result, None)
            finally:
                loop.call_soon_threadsafe(self._release)

        threading.Thread(target=work, name=f"miles-weights: {what}", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(done), left)
        except TimeoutError:
            done.add_done_callback(_retrieve)  # its late outcome is nobody's: drop it quietly
            raise DeadlineExceeded(
                f"{what} did not finish within {self.deadline_s:g} s (miles serve "
                "--weight-timeout); weight operations wait until it ends"
            ) from None

    def _busy(self, what: str) -> LaneBusy:
        held = self._running
        doing = f"{held[0]}, running for {time.monotonic() - held[1]:.0f} s" if held else "queued"
        return LaneBusy(
            f"{what}: other weight operations held the server for its whole "
            f"{self.deadline_s:g} s deadline ({doing}); retry later"
        )

    def _release(self) -> None:
        self._running = None
        self._turn.release()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future[T], result: T | None, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)  # type: ignore[arg-type]
