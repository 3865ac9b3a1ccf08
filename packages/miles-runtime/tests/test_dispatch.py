"""The dispatcher: batching concurrent requests onto the ready engines, requeueing what failed
engines and weight updates cut short, and obeying the engine group's routes. No Ray: fake
engines stream their results as Ray's streaming generators do."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from miles.core.contracts.backends import EngineUnavailable
from miles.runtime.actors.engine_pool import EngineFailedError
from miles.runtime.rollout.dispatch import EngineDispatcher, RequestLostError, Route, Routes

from .fakes import FakeEngine, request


class Setup:
    def __init__(self, n: int = 2, **options: Any) -> None:
        self.engines = [FakeEngine() for _ in range(n)]
        self.failures: list[tuple[int, int, str]] = []
        self.dispatcher = EngineDispatcher(
            lambda i, g, reason: self.failures.append((i, g, reason)),
            request_timeout_s=options.pop("timeout", 5.0),
            **options,
        )
        self.epoch = 0
        self.route(range(n))

    def route(self, ready: Any, held: bool = False, fatal: str | None = None) -> None:
        self.epoch += 1
        routes = tuple(Route(i, 0, self.engines[i]) for i in ready)
        self.dispatcher.set_routes(Routes(self.epoch, routes, held=held, fatal=fatal))


def test_requests_of_one_tick_go_out_together_split_over_the_engines() -> None:
    async def main() -> None:
        s = Setup(2)
        calls = [s.dispatcher.generate([request(g * 10 + i) for i in range(3)]) for g in range(4)]
        results = await asyncio.gather(*calls)
        # 12 requests in one flush, alternating over two engines: one call each.
        assert [len(c) for e in s.engines for c in e.calls] == [6, 6]
        for g, group in enumerate(results):
            assert [r.request_id for r in group] == [g * 10 + i for i in range(3)]
            assert all(len(r.response_ids) == 2 and r.finish_reason == "length" for r in group)
        assert s.dispatcher.busy_s > 0

    asyncio.run(main())


def test_one_at_a_time_requests_go_to_the_engine_with_the_fewest_in_flight() -> None:
    """Multi-turn and agent episodes send one request per call: each goes where the least is
    in flight, not always to the first engine."""

    async def main() -> None:
        s = Setup(2, timeout=0.5)
        s.engines[0].hang = True  # the first request stays in flight on engine 0
        first = asyncio.ensure_future(s.dispatcher.generate([request(1)]))
        await asyncio.sleep(0.05)
        (second,) = await s.dispatcher.generate([request(2)])
        assert second.request_id == 2
        assert s.engines[0].calls == [[1]] and s.engines[1].calls == [[2]]
        await first  # engine 0 times out; its request finishes on engine 1

    asyncio.run(main())


@pytest.mark.parametrize(
    "death",
    # The actor died, or the engine lost what it runs on (e.g. an attached server).
    [ActorDiedError(), EngineUnavailable("http://127.0.0.1:1/generate: connection refused")],
    ids=["ActorDiedError", "EngineUnavailable"],
)
def test_a_dead_engine_is_reported_once_and_its_requests_finish_elsewhere(death) -> None:
    async def main() -> None:
        s = Setup(2)
        s.engines[0].fail, s.engines[0].after = death, 1  # one result, then death
        results = await s.dispatcher.generate([request(i) for i in range(6)])
        assert [r.request_id for r in results] == list(range(6))
        assert all(r.finish_reason == "length" for r in results)
        assert [(i, g) for i, g, _ in s.failures] == [(0, 0)]
        assert type(death).__name__ in s.failures[0][2]
        assert s.dispatcher.requeued == 2  # engine 0 had 3 requests and finished one
        assert [r.index for r in s.dispatcher.ready()] == [1]  # skipped until the group says

    asyncio.run(main())


class _DroppingDispatcher(EngineDispatcher):
    """A dispatcher with a bookkeeping bug: a dead engine's unfinished requests are dropped
    instead of queued again."""

    def _engine_failed(self, route: Route, reason: str, unfinished: dict[int, Any]) -> None:
        self.report_failure(route.index, route.generation, reason)


def test_a_request_lost_by_the_dispatcher_fails_its_caller_at_once_naming_it() -> None:
    async def main() -> None:
        s = Setup(2)
        s.dispatcher = _DroppingDispatcher(
            lambda i, g, reason: s.failures.append((i, g, reason)), request_timeout_s=5.0
        )
        s.route(range(2))
        s.engines[0].fail, s.engines[0].after = ActorDiedError(), 1  # one result, then death
        # Engine 0 takes requests 0, 2 and 4 and finishes 0; 2 and 4 are dropped.
        call = s.dispatcher.generate([request(i) for i in range(6)])
        with pytest.raises(RequestLostError, match=r"requests \[2, 4\] were lost .* engine 0"):
            await asyncio.wait_for(call, timeout=5)  # not a wait forever

    asyncio.run(main())


def test_a_hung_engine_times_out_and_is_reported() -> None:
    async def main() -> None:
        s = Setup(2, timeout=0.2)
        s.engines[1].hang = True
        results = await s.dispatcher.generate([request(i) for i in range(4)])
        assert len(results) == 4 and all(r.finish_reason == "length" for r in results)
        assert len(s.failures) == 1 and s.failures[0][0] == 1
        assert "fault.request_timeout_s" in s.failures[0][2]

    asyncio.run(main())


def test_an_error_of_the_engine_itself_reaches_the_caller() -> None:
    async def main() -> None:
        s = Setup(1)
        s.engines[0].fail = ValueError("empty prompt")
        with pytest.raises(ValueError, match="empty prompt"):
            await s.dispatcher.generate([request(0)])
        assert s.failures == []  # not an engine failure: nothing to restart

    asyncio.run(main())


def test_held_routes_keep_requests_waiting_until_released() -> None:
    async def main() -> None:
        s = Setup(1)
        s.route([0], held=True)
        pending = asyncio.ensure_future(s.dispatcher.generate([request(0)]))
        await asyncio.sleep(0.05)
        assert not pending.done() and s.engines[0].calls == []
        s.route([0])
        assert (await pending)[0].response_ids
        await s.dispatcher.drained()

    asyncio.run(main())


def test_older_routes_arriving_late_are_ignored() -> None:
    async def main() -> None:
        s = Setup(1)
        s.dispatcher.set_routes(Routes(s.epoch + 2, (Route(0, 0, s.engines[0]),)))
        s.dispatcher.set_routes(Routes(s.epoch + 1, (), held=True))  # overtaken on the way
        assert not s.dispatcher.routes.held
        assert len(await s.dispatcher.generate([request(0)])) == 1

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["continue", "requeue"])
def test_requests_cut_short_by_a_weight_update(mode: str) -> None:
    """An abort hands back the tokens so far: continued with the new weights (per-token
    versions), or started again from the prompt."""

    async def main() -> None:
        s = Setup(1, on_weight_update=mode)
        engine = s.engines[0]
        engine.tokens = 2  # each call makes 2 tokens; max_new_tokens is 4
        original = engine._items

        def first_call_aborts(requests: Any) -> Any:
            items = original(requests)
            if len(engine.calls) == 1:
                items = [
                    [type(r)(r.request_id, r.response_ids, r.logprobs, "abort", 0) for r in item]
                    for item in items
                ]
            return items

        engine._items = first_call_aborts  # type: ignore[method-assign]
        engine.version = 1
        [result] = await s.dispatcher.generate([request(7, max_new_tokens=4)])
        if mode == "continue":
            assert len(result.response_ids) == 4 and result.weight_version == [0, 0, 1, 1]
        else:
            assert len(result.response_ids) == 2 and result.weight_version == 1
        assert s.dispatcher.requeued == 1

    asyncio.run(main())


def test_a_fatal_engine_failure_is_raised_by_check() -> None:
    async def main() -> None:
        s = Setup(1)
        s.dispatcher.check()
        s.route([], fatal="rollout engine 0 failed and was restarted 3 times")
        with pytest.raises(EngineFailedError, match="restarted 3 times"):
            s.dispatcher.check()

    asyncio.run(main())
