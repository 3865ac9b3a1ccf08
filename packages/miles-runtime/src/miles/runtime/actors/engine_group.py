"""The engine group actor: owns the rollout engines as a set, and is driven by the controller.

It holds the engines' membership (which are ready, restarting, or back but stale, through the
`EnginePool`), supervises them (health checks, restarts), and makes every engine-wide move:
pause and resume around a weight update, the weight-sync group and its fan-out, the colocated
memory hand-over, checksums, versions and RNG states for checkpoints.

The rollout manager generates through the engines directly (no hop through this actor): the
group tells its dispatcher which engines are ready (`Routes`), and hears from it which failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeAlias, TypeVar

import ray
import structlog
from ray import ObjectRef
from ray.actor import ActorProxy

from miles.core.config import FaultConfig
from miles.core.contracts.weight_sync import SyncPlan
from miles.runtime.actors.engine_pool import EnginePool, EngineSlot, Launcher
from miles.runtime.cluster.process import flush_traces, init_actor_process, kill_actor
from miles.runtime.rollout.dispatch import EngineSupervisor, Route, Routes

if TYPE_CHECKING:
    from miles.runtime.actors.engine_actor import EngineHandle
    from miles.runtime.rollout.rollout_manager import RolloutHandle

log = structlog.get_logger(__name__)
T = TypeVar("T")


class EngineGroup(EngineSupervisor):
    def __init__(
        self,
        fault: FaultConfig,
        run_dir: str | None,
        handles: list[EngineHandle],
        launcher: Launcher | None = None,
    ) -> None:
        init_actor_process(run_dir, role="engine_group")
        self.pool = EnginePool(launcher, handles, fault, on_change=self._publish, kill=_kill)
        self._subscriber: RolloutHandle | None = None  # the rollout manager
        self._held = False
        self._epoch = 0  # of the routes pushed last
        # (slot, generation) of each engine in the current weight-sync group: a restarted engine
        # is a new member even in its old slot. None: there is no usable group (none built yet,
        # or a sync broke it).
        self._members: list[tuple[int, int]] | None = None

    # ── the rollout manager's side ───────────────────────────────────────────────────────────────

    @ray.method
    async def connect(self, rollout_manager: RolloutHandle) -> None:
        """The rollout manager generates on the ready engines; it gets the routes from now on."""
        self._subscriber = rollout_manager
        await self._push()
        self.pool.start_health_checks()

    @ray.method
    def engine_failed(self, index: int, generation: int, reason: str) -> None:
        """The dispatcher saw engine `index` die or hang inside generate."""
        self.pool.fail(index, generation, reason)

    def routes(self) -> Routes:
        self._epoch += 1
        pool = self.pool
        ready = tuple(Route(s.index, s.generation, s.handle) for s in pool.ready())
        return Routes(
            self._epoch,
            ready,
            held=self._held,
            fatal=pool.fatal,
            restarts=pool.restarts_total,
            dropped=pool.dropped_total,
        )

    @ray.method
    def fault_counts(self) -> dict[str, float]:
        """The engine faults so far, as the metrics name them (the last step's row may predate
        a restart that finished after its batch was taken)."""
        return {
            "fault/engine_restarts": float(self.pool.restarts_total),
            "fault/engines_dropped": float(self.pool.dropped_total),
        }

    def _publish(self) -> None:
        """A slot changed. During an update the dispatcher is held anyway, and the update's end
        pushes the routes; a fatal error goes out at once."""
        if self._subscriber is not None and (not self._held or self.pool.fatal is not None):
            self._subscriber.set_routes.remote(self.routes())

    async def _push(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.set_routes.remote(self.routes())

    # ── weight updates ───────────────────────────────────────────────────────────────────────────

    @ray.method
    async def begin_update(self) -> bool:
        """Holds new requests, pauses every engine (each hands back what it was doing), and
        returns once nothing runs on any; whether the sync group must be rebuilt (an engine was
        restarted since it was built)."""
        self.pool.check()
        self._held = True
        # Together: the dispatcher holds as soon as the routes arrive and then waits for what is
        # on the engines, which the pause hands back. (A request it sent to an engine paused a
        # moment earlier comes back aborted and waits in its queue.)
        held = self._subscriber.hold.remote(self.routes()) if self._subscriber else _done()
        await asyncio.gather(
            *(_quietly(s.handle.pause.remote()) for s in self.pool.alive()), _await(held)
        )
        return self._members is None or self._alive_members() != self._members

    @ray.method
    def sync_world(self) -> int:
        """Fixes the members of the next weight-sync group (the alive engines); its world size
        (rank 0 is the trainer)."""
        self._members = self._alive_members()
        return len(self._members) + 1

    @ray.method
    async def join_sync(self, host: str, port: int) -> None:
        """The members join the new group (as the trainer does, at the same time)."""
        world = len(self._member_slots()) + 1
        await asyncio.gather(
            *(
                s.handle.join_weight_sync.remote(host, port, world, rank + 1)
                for rank, s in enumerate(self._member_slots())
            )
        )

    @ray.method
    async def receive_weights(self, plan: SyncPlan, version: int, trace: dict[str, str]) -> None:
        await asyncio.gather(
            *(s.handle.receive_weights.remote(plan, version, trace) for s in self._member_slots())
        )

    @ray.method
    def in_place_targets(self) -> list[EngineHandle | None]:
        """Colocated sync: engine i's handle at index i (it shares train rank i's GPU), None
        where an engine is down. Those alive become the members."""
        self._members = self._alive_members()
        alive = set(self._members)
        return [s.handle if (s.index, s.generation) in alive else None for s in self.pool.slots]

    @ray.method
    async def end_update(self) -> None:
        """The members hold the new weights: stale engines are ready, everyone resumes."""
        self.pool.mark_synced(self._members or [])
        await asyncio.gather(*(_quietly(s.handle.resume.remote()) for s in self._member_slots()))
        self._held = False
        await self._push()

    @ray.method
    async def abort_sync(self) -> None:
        """A weight sync broke off: every engine leaves the group (which ends a receive still
        waiting on it), and those that died in it are restarted. The next sync builds a new
        group."""
        await self._abort_sync()

    async def _abort_sync(self) -> None:
        self._members = None
        alive = self.pool.alive()
        await asyncio.gather(*(_quietly(s.handle.leave_weight_sync.remote()) for s in alive))
        for slot in alive:
            try:
                await asyncio.wait_for(_await(slot.handle.health.remote()), 30)
            except Exception as exc:
                self.pool.fail(slot.index, slot.generation, f"died during a weight sync: {exc!r}")

    @ray.method
    async def await_engines(self) -> None:
        """Returns once no engine is mid-restart (each came back, or was dropped past its
        restart budget); raises if none is left."""
        while self.pool.restarting():
            await asyncio.sleep(0.05)
        self.pool.check()

    @ray.method
    async def reset_sync_group(self) -> None:
        """The trainer side of the group is new (a train-group restart): rebuild before use."""
        await self._abort_sync()

    @ray.method
    def needs_recovery(self) -> bool:
        """No engine can take requests until a weight sync (every one is stale after a
        restart)."""
        self.pool.check()
        return not self.pool.ready() and bool(self.pool.stale())

    def _alive_members(self) -> list[tuple[int, int]]:
        return [(s.index, s.generation) for s in self.pool.alive()]

    def _member_slots(self) -> list[EngineSlot]:
        return [self.pool.slots[i] for i, _ in self._members or []]

    # ── memory, state and checks ─────────────────────────────────────────────────────────────────

    @ray.method
    async def release_memory(self) -> None:
        """Colocated: the trainer is about to use the GPUs."""
        await self._each("release_memory", lambda engine: engine.release_memory.remote())

    @ray.method
    async def resume_memory(self) -> None:
        await self._each("resume_memory", lambda engine: engine.resume_memory.remote())

    async def _each(
        self, method: str, call: Callable[[EngineHandle], ObjectRef[T]]
    ) -> list[T | None]:
        """`call` (engine method `method`) on every alive engine; one that fails is reported to
        the pool (which restarts it) and answers None, instead of failing the run."""

        async def one(slot: EngineSlot) -> T | None:
            try:
                return await call(slot.handle)
            except Exception as exc:
                self.pool.fail(slot.index, slot.generation, f"{method} failed: {exc!r}")
                return None

        return list(await asyncio.gather(*(one(s) for s in self.pool.alive())))

    @ray.method
    async def weights(self) -> list[tuple[int, str, int]]:
        """(engine index, checksum, weight version) of each engine of the last sync that is
        still alive, to verify that sync (one restarted since holds the checkpoint's weights
        until the next)."""
        members = set(self._members or [])
        alive = [s for s in self.pool.alive() if (s.index, s.generation) in members]
        checksums = asyncio.gather(*(s.handle.checksum.remote() for s in alive))
        versions = asyncio.gather(*(s.handle.weight_version.remote() for s in alive))
        return [
            (s.index, c, v) for s, c, v in zip(alive, await checksums, await versions, strict=True)
        ]

    @ray.method
    async def weights_dtype(self) -> str:
        """The dtype the engines hold their weights in (what the trainer's checksum casts to)."""
        health = await self.pool.alive()[0].handle.health.remote()
        return str(health["dtype"])

    @ray.method
    async def rng_states(self) -> list[str]:
        """Each slot's engine RNG state ("" for an engine that is down or dropped: it keeps its
        own seed on resume)."""
        alive = [s.index for s in self.pool.alive()]
        got = await self._each("get_rng_state", lambda engine: engine.get_rng_state.remote())
        states = dict(zip(alive, got, strict=True))
        return [states.get(s.index) or "" for s in self.pool.slots]

    @ray.method
    async def set_rng_states(self, states: list[str]) -> None:
        if not states:
            return
        if len(states) != len(self.pool.slots):
            log.warning(
                "engine count changed since the checkpoint; engines keep their own seeds",
                saved=len(states),
                now=len(self.pool.slots),
            )
            return
        alive = {s.index for s in self.pool.alive()}
        await asyncio.gather(
            *(
                s.handle.set_rng_state.remote(r)
                for s, r in zip(self.pool.slots, states, strict=True)
                if r and s.index in alive
            )
        )

    @ray.method
    async def flush(self) -> None:
        """Sends the buffered spans of this process and of every live engine on."""
        flush_traces()
        await asyncio.gather(*(_quietly(s.handle.flush.remote()) for s in self.pool.alive()))


def _kill(handle: EngineHandle) -> None:
    kill_actor(handle)


async def _await(ref: Awaitable[T]) -> T:
    return await ref


async def _done() -> None:
    return None


async def _quietly(ref: Awaitable[object]) -> None:
    """A call to an engine that may have just died: its failure is the pool's business."""
    try:
        await ref
    except Exception as exc:
        log.warning("engine call failed", error=repr(exc))


# What `ray.remote(EngineGroup)...remote(...)` returns: the handle the controller calls it by.
EngineGroupHandle: TypeAlias = "ActorProxy[EngineGroup]"
