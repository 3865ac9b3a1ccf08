"""The engine group and its pool, without Ray: supervision (restarts with capped back-off, the
restart budget), membership of the weight-sync group, and the routes it tells the rollout
manager's dispatcher, in the order a weight update needs them."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from miles.core.config import FaultConfig
from miles.runtime.actors import engine_group
from miles.runtime.actors.engine_group import EngineGroup
from miles.runtime.actors.engine_pool import EngineFailedError, EnginePool
from miles.runtime.rollout.dispatch import Routes

from .fakes import FakeEngine, FakeHandle

FAST = FaultConfig(health_check_s=0.05, backoff_s=0.01, max_engine_restarts=2)


class Launcher:
    """Starts a fresh fake engine for a slot. `broken` slots fail their health check; a slot in
    `on_dead_node` fails it once, its node found dead afterwards (Ray noticed the death late)."""

    def __init__(self) -> None:
        self.launched: list[int] = []
        self.broken: set[int] = set()
        self.on_dead_node: set[int] = set()
        self.node_of: dict[int, str] = {}
        self.engines: list[FakeEngine] = []

    def launch(self, index: int) -> Any:
        self.launched.append(index)
        engine = FakeEngine()
        self.node_of[index] = "alive"
        if index in self.on_dead_node:
            self.on_dead_node.discard(index)
            self.node_of[index] = "dead"
            engine.health = lambda: (_ for _ in ()).throw(RuntimeError("its node has died"))  # type: ignore[method-assign]
        elif index in self.broken:
            engine.health = lambda: (_ for _ in ()).throw(RuntimeError("CUDA error"))  # type: ignore[method-assign]
        self.engines.append(engine)
        return FakeHandle(engine)

    def node_lost(self, index: int) -> bool:
        return self.node_of.get(index) == "dead"


def test_a_failed_engine_restarts_stale_and_is_ready_after_a_sync() -> None:
    async def main() -> None:
        changes: list[str] = []
        killed: list[Any] = []
        launcher = Launcher()
        pool = EnginePool(
            launcher, [FakeHandle(FakeEngine()) for _ in range(2)], FAST,
            on_change=lambda: changes.append("change"), kill=killed.append,
        )  # fmt: skip
        old = pool.slots[1].handle
        pool.fail(1, 0, "died")
        assert pool.slots[1].state == "down" and killed == [old]
        pool.fail(1, 0, "reported twice")  # the same failure, seen again: ignored
        assert len(killed) == 1
        while pool.slots[1].state == "down":
            await asyncio.sleep(0.01)
        slot = pool.slots[1]
        assert (slot.state, slot.generation, slot.restarts) == ("stale", 1, 1)
        assert launcher.launched == [1] and slot.handle is not old
        pool.fail(1, 0, "a report about the engine that was replaced")
        assert slot.state == "stale"
        assert [s.index for s in pool.ready()] == [0] and [s.index for s in pool.alive()] == [0, 1]
        pool.mark_synced([(0, 0), (1, 1)])
        assert [s.index for s in pool.ready()] == [0, 1] and pool.restarts_total == 1
        assert len(changes) >= 3  # down, stale, ready

    asyncio.run(main())


def test_past_its_restart_budget_the_last_engine_makes_the_run_fail() -> None:
    async def main() -> None:
        launcher = Launcher()
        launcher.broken.add(0)  # every restart fails its first health check
        pool = EnginePool(launcher, [FakeHandle(FakeEngine())], FAST)
        pool.fail(0, 0, "segfault")
        while pool.fatal is None:
            await asyncio.sleep(0.01)
        assert launcher.launched == [0, 0]  # fault.max_engine_restarts = 2
        with pytest.raises(EngineFailedError, match="max_engine_restarts=2") as err:
            pool.check()
        assert "restart failed: RuntimeError: CUDA error" in str(err.value)
        assert "no rollout engine is left" in str(err.value)

    asyncio.run(main())


def test_a_restart_that_lands_on_a_dead_node_is_not_one_of_the_engines_restarts() -> None:
    async def main() -> None:
        launcher = Launcher()
        launcher.on_dead_node.add(0)
        fault = dataclasses.replace(FAST, max_engine_restarts=1)
        pool = EnginePool(launcher, [FakeHandle(FakeEngine())], fault)
        pool.fail(0, 0, "node died")
        while pool.slots[0].state == "down":
            await asyncio.sleep(0.01)
        # Started twice: once where the node had died, once on a live node; one restart counted.
        assert launcher.launched == [0, 0] and pool.slots[0].state == "stale"
        assert (pool.slots[0].restarts, pool.restarts_total, pool.fatal) == (1, 1, None)

    asyncio.run(main())


def test_past_its_restart_budget_an_engine_is_dropped_and_the_others_go_on() -> None:
    async def main() -> None:
        launcher = Launcher()
        launcher.broken.add(1)
        pool = EnginePool(launcher, [FakeHandle(FakeEngine()) for _ in range(2)], FAST)
        pool.fail(1, 0, "segfault")
        while pool.slots[1].state != "dropped":
            await asyncio.sleep(0.01)
        pool.check()  # not fatal: engine 0 lives
        assert [s.index for s in pool.alive()] == [0] and pool.dropped_total == 1
        pool.fail(1, 1, "a late report about the dropped engine")  # ignored
        assert pool.slots[1].state == "dropped" and launcher.launched == [1, 1]

    asyncio.run(main())


def test_the_health_loop_fails_an_unhealthy_engine() -> None:
    async def main() -> None:
        sick = FakeEngine()
        sick.health = lambda: {"ok": False}  # type: ignore[method-assign]
        pool = EnginePool(Launcher(), [FakeHandle(FakeEngine()), FakeHandle(sick)], FAST)
        pool.start_health_checks()
        while pool.slots[1].restarts == 0:
            await asyncio.sleep(0.01)
        assert "engine reports unhealthy" in pool.slots[1].last_error
        assert pool.slots[0].restarts == 0

    asyncio.run(main())


class Subscriber:
    """The rollout manager's side: records routes and when it was asked to drain."""

    def __init__(self, engines: list[FakeEngine]) -> None:
        self.engines = engines
        self.routes: list[Routes] = []
        self.events: list[str] = []

    def set_routes(self, routes: Routes) -> None:
        self.routes.append(routes)
        self.events.append("held" if routes.held else "released")

    async def hold(self, routes: Routes) -> None:
        self.set_routes(routes)
        for _ in range(100):  # drained: once the pauses landed (a replaced engine never pauses)
            if all(e.paused for e in self.engines):
                break
            await asyncio.sleep(0)
        self.events.append(f"drained (engines paused: {all(e.paused for e in self.engines)})")


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(engine_group, "init_actor_process", lambda *a, **k: None)
    monkeypatch.setattr(engine_group, "_kill", lambda handle: None)

    def make(n: int = 2) -> tuple[EngineGroup, list[FakeEngine], Subscriber]:
        engines = [FakeEngine() for _ in range(n)]
        group = EngineGroup(FAST, None, [FakeHandle(e) for e in engines], Launcher())
        return group, engines, Subscriber(engines)

    return make


async def _sync(g: EngineGroup) -> bool:
    """One whole weight update with every alive engine; whether it rebuilt the sync group."""
    rebuilt = await g.begin_update()
    g.sync_world()
    await g.end_update()
    return rebuilt


def test_a_weight_update_holds_pauses_drains_then_resumes_and_releases(group: Any) -> None:
    async def main() -> None:
        g, engines, sub = group()
        await g.connect(FakeHandle(sub))
        assert sub.events == ["released"] and len(sub.routes[-1].ready) == 2
        assert await g.begin_update() is True  # no group was built yet
        assert sub.events[1:] == ["held", "drained (engines paused: True)"]
        assert g.sync_world() == 3  # the trainer and two engines
        await g.end_update()
        assert sub.events[-1] == "released" and not any(e.paused for e in engines)
        assert [e.log for e in engines] == [["pause", "resume"]] * 2
        assert await g.begin_update() is False  # the same members: no rebuild
        epochs = [r.epoch for r in sub.routes]
        assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs)

    asyncio.run(main())


def test_a_restarted_engine_rejoins_at_the_next_sync(group: Any) -> None:
    async def main() -> None:
        g, _, sub = group()
        await g.connect(FakeHandle(sub))
        await _sync(g)
        g.engine_failed(0, 0, "ActorDiedError")
        await asyncio.sleep(0)  # the routes go out as a message
        assert [r.index for r in sub.routes[-1].ready] == [1]
        while g.pool.slots[0].state != "stale":
            await asyncio.sleep(0.01)
        assert [r.index for r in sub.routes[-1].ready] == [1]  # stale: no requests yet
        assert await _sync(g) is True  # membership changed: the sync group was rebuilt
        routes = sub.routes[-1]
        assert [(r.index, r.generation) for r in routes.ready] == [(0, 1), (1, 0)]
        assert routes.restarts == 1

    asyncio.run(main())


def test_a_broken_sync_is_torn_down_and_waits_for_the_dead_engine(group: Any) -> None:
    async def main() -> None:
        g, engines, sub = group()
        await g.connect(FakeHandle(sub))
        await g.begin_update()
        g.sync_world()
        await g.end_update()
        engines[1].health = lambda: (_ for _ in ()).throw(RuntimeError("ActorDiedError"))  # type: ignore[method-assign]
        await g.abort_sync()  # the trainer's send failed: every side leaves the group
        assert "leave" in engines[0].log and "leave" in engines[1].log
        assert g.pool.slots[1].state == "down"  # found dead by its health check
        await g.await_engines()  # returns once it is back (stale)
        assert g.pool.slots[1].state == "stale"
        assert await g.begin_update() is True  # the next try builds a new group
        assert g.sync_world() == 3

    asyncio.run(main())


def test_an_engine_that_dies_in_an_engine_wide_call_is_restarted_not_fatal(group: Any) -> None:
    async def main() -> None:
        g, engines, sub = group()
        await g.connect(FakeHandle(sub))
        engines[0].get_rng_state = lambda: (_ for _ in ()).throw(RuntimeError("ActorDiedError"))  # type: ignore[attr-defined]
        engines[1].get_rng_state = lambda: "rng1"  # type: ignore[attr-defined]
        assert await g.rng_states() == ["", "rng1"]  # engine 0 keeps its own seed on resume
        assert g.pool.slots[0].state == "down"

    asyncio.run(main())


def test_every_engine_restarted_needs_a_resend(group: Any) -> None:
    async def main() -> None:
        g, _, sub = group(1)
        await g.connect(FakeHandle(sub))
        assert g.needs_recovery() is False
        g.engine_failed(0, 0, "hung")
        while g.pool.slots[0].state != "stale":
            await asyncio.sleep(0.01)
        assert g.needs_recovery() is True

    asyncio.run(main())


def test_an_engine_restarted_after_the_members_were_fixed_stays_stale(group: Any) -> None:
    """Engine 1 comes back while a sync is under way (its members already fixed): the sync's
    end makes the members ready, not it; verification asks the members only; the next update
    rebuilds the group with it."""

    async def main() -> None:
        g, _, sub = group()
        await g.connect(FakeHandle(sub))
        await _sync(g)
        g.engine_failed(0, 0, "ActorDiedError")
        g.engine_failed(1, 0, "ActorDiedError")
        while g.pool.slots[0].state != "stale" or g.pool.slots[1].state != "stale":
            await asyncio.sleep(0.01)
        g.pool.slots[1].state = "down"  # as if engine 1 were still restarting...
        await g.begin_update()
        assert g.sync_world() == 2  # ...when the members are fixed: the trainer and engine 0
        g.pool.slots[1].state = "stale"  # it is back before the sync ends
        await g.end_update()
        assert [s.state for s in g.pool.slots] == ["ready", "stale"]
        assert [(r.index, r.generation) for r in sub.routes[-1].ready] == [(0, 1)]
        assert len(await g.weights()) == 1  # only the sync's member is checked
        assert await g.begin_update() is True  # the next update takes engine 1 in

    asyncio.run(main())
