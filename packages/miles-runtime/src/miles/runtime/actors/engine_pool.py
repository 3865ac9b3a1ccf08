"""The rollout engines under supervision: health checks, restarts with capped back-off.

Each engine lives in a slot. A slot is `ready` (takes requests), `down` (dead or hung; a restart
is under way), `stale` (restarted, holding the base model's weights until the next weight sync
brings it to the current version) or `dropped`. Each restart bumps the slot's `generation`, so a
failure reported against an engine that was already replaced is ignored. An engine that fails more
than `fault.max_engine_restarts` times is dropped and the run goes on with the others; only when
every engine is dropped does the run fail, with the last error (`fatal`).

No Ray actor of its own: the engine group hosts it, and tests drive it with fake engines.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import structlog

from miles.core.config import FaultConfig

if TYPE_CHECKING:
    from miles.runtime.actors.engine_actor import EngineHandle

log = structlog.get_logger(__name__)
T = TypeVar("T")

SlotState = Literal["ready", "down", "stale", "dropped"]


class EngineFailedError(RuntimeError):
    """Every engine failed past its restart budget: the run cannot go on."""


class Launcher(Protocol):
    """Starts engine `index` (again), returning its actor handle."""

    def launch(self, index: int) -> EngineHandle: ...

    def node_lost(self, index: int) -> bool:
        """Whether the node engine `index` was last started on has died since."""
        ...


@dataclass
class EngineSlot:
    index: int
    handle: EngineHandle
    state: SlotState = "ready"
    restarts: int = 0
    generation: int = 0  # bumped by every restart
    last_error: str = ""


@dataclass
class EnginePool:
    launcher: Launcher | None  # None: engines cannot be restarted (failures are fatal)
    handles: list[EngineHandle]
    fault: FaultConfig
    on_change: Callable[[], None] = lambda: None  # called when a slot changes state
    kill: Callable[[EngineHandle], None] = lambda handle: None  # stops a failed engine for good
    slots: list[EngineSlot] = field(init=False)
    restarts_total: int = 0
    dropped_total: int = 0
    fatal: str | None = None  # set when the last engine is dropped

    def __post_init__(self) -> None:
        self.slots = [EngineSlot(i, h) for i, h in enumerate(self.handles)]
        self._tasks: set[asyncio.Task[None]] = set()

    # ── what is usable ───────────────────────────────────────────────────────────────────────────

    def ready(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state == "ready"]

    def alive(self) -> list[EngineSlot]:
        """Engines that can take part in a weight sync: ready ones and restarted (stale) ones."""
        return [s for s in self.slots if s.state in ("ready", "stale")]

    def restarting(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state == "down"]

    def stale(self) -> list[EngineSlot]:
        return [s for s in self.slots if s.state == "stale"]

    def check(self) -> None:
        if self.fatal is not None:
            raise EngineFailedError(self.fatal)

    # ── failures ─────────────────────────────────────────────────────────────────────────────────

    def fail(self, index: int, generation: int, reason: str) -> None:
        """Takes the engine out of rotation, kills it, and restarts it in the background. A
        report about an earlier generation of the slot (already replaced) is ignored."""
        slot = self.slots[index]
        if slot.state in ("down", "dropped") or slot.generation != generation:
            return
        # Ray's actor-death text runs to a dozen lines: its first says what happened.
        reason = reason.strip().splitlines()[0][:300] if reason.strip() else reason
        slot.state, slot.last_error = "down", reason
        log.warning(
            "engine failed; restarting it", fault="engine_failed", engine=slot.index, reason=reason
        )
        self.kill(slot.handle)
        self._spawn(self._restart(slot))
        self.on_change()

    async def _restart(self, slot: EngineSlot) -> None:
        while True:
            if self.launcher is None or slot.restarts >= self.fault.max_engine_restarts:
                self._drop(slot)
                return
            delay = min(self.fault.backoff_s * 2**slot.restarts, self.fault.backoff_max_s)
            slot.restarts += 1
            self.restarts_total += 1
            await asyncio.sleep(delay)
            try:
                # Blocks while a lost node's bundle waits for a place (up to fault.node_wait_s).
                handle = await asyncio.to_thread(self.launcher.launch, slot.index)
            except Exception as exc:
                self._restart_failed(slot, exc)
                continue
            try:
                # A new engine loads its model first (minutes, for a large one).
                health = await asyncio.wait_for(
                    _ref(handle.health.remote()), self.fault.start_timeout_s
                )
            except Exception as exc:
                self.kill(handle)
                if self.launcher.node_lost(slot.index):
                    # Ray had not yet noticed a node's death and started the engine in the dead
                    # node's bundle: not a failure of the engine's, so not one of its restarts.
                    slot.restarts -= 1
                    self.restarts_total -= 1
                    log.warning(
                        "engine restart landed on a dead node; placing it again", engine=slot.index
                    )
                    continue
                self._restart_failed(slot, exc)
                continue
            slot.handle, slot.state = handle, "stale"
            slot.generation += 1
            log.info(
                "engine restarted; it rejoins at the next weight sync",
                fault="engine_restarted",
                engine=slot.index,
                node_id=health.get("node_id") if isinstance(health, dict) else None,
            )
            self.on_change()
            return

    def _restart_failed(self, slot: EngineSlot, exc: Exception) -> None:
        slot.last_error = f"restart failed: {type(exc).__name__}: {exc}"
        log.warning(
            "engine restart failed; trying again",
            engine=slot.index,
            attempt=slot.restarts,
            error=slot.last_error[:500],
        )

    def _drop(self, slot: EngineSlot) -> None:
        """Past its restart budget: the run goes on without the engine, unless it was the last."""
        slot.state = "dropped"
        self.dropped_total += 1
        reason = (
            f"rollout engine {slot.index} failed and was restarted {slot.restarts} times "
            f"(fault.max_engine_restarts={self.fault.max_engine_restarts}); last error: "
            f"{slot.last_error}"
        )
        if all(s.state == "dropped" for s in self.slots):
            self.fatal = f"{reason}; no rollout engine is left"
            log.error("the last engine is past its restart budget", error=self.fatal)
        else:
            log.warning(
                "engine dropped; the run goes on with the others",
                fault="engine_dropped",
                engine=slot.index,
                reason=reason,
                engines_left=sum(s.state != "dropped" for s in self.slots),
            )
        self.on_change()

    def mark_synced(self, members: Iterable[tuple[int, int]]) -> None:
        """After a weight sync: its members, (slot, generation) pairs, hold the new weights, so
        the stale ones among them are ready. An engine restarted after the members were fixed
        stays stale (its weights are the checkpoint's) until the next sync."""
        synced = set(members)
        for slot in self.stale():
            if (slot.index, slot.generation) in synced:
                slot.state = "ready"
        self.on_change()

    # ── health checks ────────────────────────────────────────────────────────────────────────────

    def start_health_checks(self) -> None:
        self._spawn(self._health_loop())

    async def _health_loop(self) -> None:
        interval = self.fault.health_check_s
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(self._check_one(s, interval) for s in self.ready()))

    async def _check_one(self, slot: EngineSlot, timeout: float) -> None:
        t0, generation = time.monotonic(), slot.generation
        try:
            health = await asyncio.wait_for(_ref(slot.handle.health.remote()), timeout)
            if not health.get("ok", True):
                raise RuntimeError(f"engine reports unhealthy: {health}")
        except Exception as exc:
            waited = time.monotonic() - t0
            self.fail(slot.index, generation, f"health check failed after {waited:.1f}s: {exc!r}")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _ref(ref: Awaitable[T]) -> T:
    """An object ref as a coroutine (what `asyncio.wait_for` gets)."""
    return await ref
