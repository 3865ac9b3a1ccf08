"""The weight updater: the sync protocol between train group and engine group, redoing a broken
sync, and the verification that must fail whenever an engine holds other weights than the
trainer's. No Ray: fake actor handles answer at once, and `ray.get` unwraps their answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.testing import capture_logs

from miles.core.config import RunConfig
from miles.core.contracts.weight_sync import Bucket, SyncPlan, TensorMeta
from miles.core.observability import telemetry
from miles.runtime.actors.train_group import TrainerDied
from miles.runtime.loop import weight_updates
from miles.runtime.loop.weight_updates import (
    EngineWeights,
    WeightSyncError,
    WeightUpdater,
    check_engine_weights,
)

TRAINER = "a" * 64  # the trainer's checksum


# ── check_engine_weights: the comparison itself ─────────────────────────────────────────────────


def test_engines_holding_the_trainers_weights_at_the_version_pass() -> None:
    check_engine_weights(TRAINER, 3, [EngineWeights(0, TRAINER, 3), EngineWeights(1, TRAINER, 3)])
    check_engine_weights(TRAINER, 3, [])  # no engine alive to check


def test_an_engine_with_another_checksum_is_named_with_what_it_holds() -> None:
    engines = [EngineWeights(0, TRAINER, 3), EngineWeights(2, "b" * 64, 3)]
    with pytest.raises(WeightSyncError) as err:
        check_engine_weights(TRAINER, 3, engines)
    message = str(err.value)
    assert "engine 2 holds version 3 with checksum bbbbbbbbbbbbbbbb" in message
    assert "engine 0" not in message
    assert "at version 3" in message and "the trainer's checksum is aaaaaaaaaaaaaaaa" in message


def test_an_engine_at_an_older_version_is_named_even_with_the_same_checksum() -> None:
    engines = [EngineWeights(0, TRAINER, 2), EngineWeights(1, TRAINER, 3)]
    with pytest.raises(WeightSyncError, match=r"engine 0 holds version 2 with checksum a{16}"):
        check_engine_weights(TRAINER, 3, engines)


def test_every_wrong_engine_is_named() -> None:
    engines = [
        EngineWeights(0, "c" * 64, 3),
        EngineWeights(1, TRAINER, 3),
        EngineWeights(4, TRAINER, 4),  # a newer version is wrong too
        EngineWeights(5, "d", 3),
    ]
    with pytest.raises(WeightSyncError) as err:
        check_engine_weights(TRAINER, 3, engines)
    assert str(err.value).count("holds version") == 3
    assert "engine 0 holds version 3" in str(err.value)
    assert "engine 4 holds version 4" in str(err.value)
    assert "engine 5 holds version 3 with checksum d;" in str(err.value)


# ── the updater, against fake train and engine groups ───────────────────────────────────────────


class _Ref:
    """What `.remote()` returns: the answer, or the error `ray.get` raises."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.value, self.error = None, None
        try:
            self.value = fn(*args)
        except Exception as exc:
            self.error = exc


def _get(ref: Any, **_: Any) -> Any:
    if isinstance(ref, list):
        return [_get(r) for r in ref]
    if ref.error is not None:
        raise ref.error
    return ref.value


class _Method:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> _Ref:
        return _Ref(self.fn, *args)


class _Handle:
    def __init__(self, target: Any) -> None:
        self._target = target

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name))


@dataclass
class World:
    """Both sides of a sync: what the engines hold, and every call made, in order."""

    engines: int = 2
    calls: list[str] = field(default_factory=list)
    held: dict[int, tuple[str, int]] = field(default_factory=dict)  # engine -> checksum, version
    corrupt: dict[int, int] = field(default_factory=dict)  # engine -> receives still corrupted
    fail_sends: int = 0  # sends that raise (an engine died in the broadcast)
    trainer_dies: bool = False
    rebuild: bool = True  # begin_update's answer
    plan: SyncPlan = field(default_factory=SyncPlan)  # what the trainer plans to send
    sent_bytes: int = 1000  # what a send reports
    # (call, plan, trace carrier) of each receive and send
    handed: list[tuple[str, Any, Any]] = field(default_factory=list)
    now: float = 100.0  # the clock `time.perf_counter` reads
    send_s: float = 0.0  # how long a send takes
    checksum_s: float = 0.0  # how long the trainer's checksum takes

    # the engine group
    def begin_update(self) -> bool:
        self.calls.append("begin_update")
        return self.rebuild

    def sync_world(self) -> int:
        self.calls.append("sync_world")
        return self.engines + 1

    def join_sync(self, host: str, port: int) -> None:
        self.calls.append(f"join_sync {host}:{port}")

    def receive_weights(self, plan: SyncPlan, version: int, trace: Any) -> None:
        self.calls.append(f"receive v{version}")
        self.handed.append(("receive", plan, trace))

    def in_place_targets(self) -> list[Any]:
        self.calls.append("in_place_targets")
        return ["engine0", None]

    def end_update(self) -> None:
        self.calls.append("end_update")

    def abort_sync(self) -> None:
        self.calls.append("abort_sync")

    def await_engines(self) -> None:
        self.calls.append("await_engines")

    def weights_dtype(self) -> str:
        self.calls.append("weights_dtype")
        return "bfloat16"

    def weights(self) -> list[tuple[int, str, int]]:
        return [(i, *self.held[i]) for i in range(self.engines)]

    # the rollout manager
    def finish_in_flight(self) -> None:
        self.calls.append("finish_in_flight")

    def weights_updated(self, version: int, synced_through: int) -> None:
        self.calls.append(f"weights_updated v{version} through {synced_through}")


@dataclass
class Trainers:
    """The train group's side of `world`: its methods, as `TrainGroup` has them."""

    world: World

    def _alive(self) -> World:
        if self.world.trainer_dies:
            raise TrainerDied(RuntimeError("rank 0 died"))
        return self.world

    def checksum(self, dtype: str | None) -> str:
        world = self._alive()
        world.calls.append(f"checksum {dtype}")
        world.now += world.checksum_s
        return TRAINER

    def send_weights(self, plan: SyncPlan, version: int, trace: Any) -> int:
        return self._send("send_weights", plan, version, trace)

    def send_weights_in_place(
        self, plan: SyncPlan, version: int, engines: list[Any], trace: Any
    ) -> int:
        return self._send("send_weights_in_place", plan, version, trace)

    def _send(self, method: str, plan: SyncPlan, version: int, trace: Any) -> int:
        world = self._alive()
        world.calls.append(f"{method} v{version}")
        world.handed.append((method, plan, trace))
        world.now += world.send_s
        if world.fail_sends:
            world.fail_sends -= 1
            raise RuntimeError("gloo: connection closed by peer")
        for i in range(world.engines):
            world.held[i] = (TRAINER, version)
            if world.corrupt.get(i):
                world.corrupt[i] -= 1
                world.held[i] = ("f" * 64, version)
        return world.sent_bytes

    def sync_address(self) -> tuple[str, int]:
        return ("10.0.0.1", 4567)

    def join_sync(self, host: str, port: int, world_size: int) -> None:
        self._alive().calls.append(f"trainer join_sync world={world_size}")

    def leave_sync(self) -> None:
        self._alive().calls.append("leave_sync")

    def sync_plan(self, bucket_bytes: int) -> SyncPlan:
        world = self._alive()
        world.calls.append(f"sync_plan {bucket_bytes}")
        return world.plan


def _updater(
    world: World, monkeypatch: pytest.MonkeyPatch, colocated: bool = False, **config: Any
) -> WeightUpdater:
    monkeypatch.setattr(weight_updates.ray, "get", _get)
    monkeypatch.setattr(weight_updates, "time", SimpleNamespace(perf_counter=lambda: world.now))
    cfg = RunConfig()
    cfg.rollout.engines = world.engines
    cfg.fault.max_engine_restarts = 1
    cfg.mode = config.pop("mode", "sync")
    for key, value in config.items():  # section__name=value
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    handle = _Handle(world)
    return WeightUpdater(cfg, Trainers(world), handle, handle, colocated)  # type: ignore[arg-type]


def test_a_sync_sends_verifies_and_releases_the_engines_in_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World()
    updater = _updater(world, monkeypatch)
    metrics = updater.sync(step=4)
    assert world.calls == [
        "begin_update",
        "sync_world",
        "join_sync 10.0.0.1:4567",
        "trainer join_sync world=3",
        "receive v1",
        "send_weights v1",
        "weights_dtype",
        "checksum bfloat16",
        "end_update",
        "weights_updated v1 through 4",
    ]
    assert updater.version == 1 and updater.synced_through == 4
    assert metrics["weights/version"] == 1.0 and metrics["weights/sync_bytes"] == 1000.0
    assert metrics["perf/sync_s"] >= metrics["perf/sync_verify_s"] >= 0
    assert metrics["perf/sync_gbps"] > 0


def test_the_same_version_again_brings_restarted_engines_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World()
    updater = _updater(world, monkeypatch)
    updater.sync(step=0)
    world.calls.clear()
    world.rebuild = False  # the group stands: no new rendezvous
    updater.sync(step=7, new_version=False)
    assert updater.version == 1 and updater.synced_through == 0
    assert world.calls == [
        "begin_update",
        "receive v1",
        "send_weights v1",
        "checksum bfloat16",  # the engines' dtype is asked once per run
        "end_update",
        "weights_updated v1 through 0",
    ]


def test_an_engine_corrupted_once_gets_the_weights_again_before_it_resumes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(corrupt={1: 1})
    updater = _updater(world, monkeypatch)
    updater.sync(step=0)
    sends = [c for c in world.calls if c.startswith("send_weights")]
    assert sends == ["send_weights v1", "send_weights v1"]  # the same version, sent again
    assert world.calls.index("end_update") > world.calls.index("checksum bfloat16")
    assert world.calls[-2:] == ["end_update", "weights_updated v1 through 0"]
    assert "finish_in_flight" not in world.calls  # sync mode: nothing is in flight
    assert updater.version == 1


def test_an_engine_that_stays_corrupted_stops_the_run_without_resuming(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(corrupt={1: 99})
    updater = _updater(world, monkeypatch)
    with pytest.raises(WeightSyncError) as err:
        updater.sync(step=2)
    assert "engine 1 holds version 1 with checksum ffffffffffffffff" in str(err.value)
    assert "also after the weights were sent again" in str(err.value)
    assert "engine 0" not in str(err.value)
    assert "end_update" not in world.calls  # the engines never generate with those weights
    assert updater.version == 0 and updater.synced_through == -1


def test_an_older_version_on_an_engine_fails_verification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World()
    updater = _updater(world, monkeypatch)

    def stale_engine() -> list[tuple[int, str, int]]:
        return [(0, TRAINER, 1), (1, TRAINER, 0)]  # engine 1 kept version 0's tensors

    monkeypatch.setattr(world, "weights", stale_engine)
    with pytest.raises(WeightSyncError, match="engine 1 holds version 0"):
        updater.sync(step=0)
    assert "end_update" not in world.calls


def test_verification_off_never_asks_for_checksums(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(corrupt={0: 1})
    updater = _updater(world, monkeypatch, rollout__verify_weights=False)
    updater.sync(step=0)
    assert not [c for c in world.calls if c.startswith(("checksum", "weights_dtype"))]
    assert updater.version == 1


def test_a_broken_sync_is_torn_down_and_redone(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World(fail_sends=1)
    updater = _updater(world, monkeypatch)
    updater.sync(step=0)
    first_send = world.calls.index("send_weights v1")
    assert world.calls[first_send + 1 : first_send + 4] == [
        "leave_sync",
        "abort_sync",
        "await_engines",
    ]
    assert world.calls.count("send_weights v1") == 2
    assert world.calls.count("begin_update") == 2
    assert updater.version == 1


def test_a_sync_broken_every_time_fails_after_the_bounded_tries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(fail_sends=100)
    updater = _updater(world, monkeypatch)  # (1 restart + 1) x 2 engines + 1 = 5 tries
    with pytest.raises(WeightSyncError, match="weight sync to version 1 failed 5 times"):
        updater.sync(step=0)
    assert world.calls.count("send_weights v1") == 5
    assert world.calls.count("leave_sync") == 4
    assert updater.version == 0


def test_a_lost_trainer_is_left_to_the_controller(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World()
    updater = _updater(world, monkeypatch)
    world.trainer_dies = True
    with pytest.raises(TrainerDied):
        updater.sync(step=0)
    assert "leave_sync" not in world.calls and "end_update" not in world.calls


def test_colocated_weights_go_in_place_to_each_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World()
    updater = _updater(world, monkeypatch, colocated=True)
    updater.sync(step=1)
    assert world.calls[:3] == ["begin_update", "in_place_targets", "send_weights_in_place v1"]
    assert "sync_world" not in world.calls and "receive v1" not in world.calls


def test_batches_in_flight_finish_before_the_first_try_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(fail_sends=1)
    updater = _updater(world, monkeypatch, mode="one_step_off")
    updater.sync(step=0)
    assert world.calls.count("finish_in_flight") == 1
    assert world.calls.index("finish_in_flight") < world.calls.index("begin_update")
    world.calls.clear()
    updater.sync(step=1, new_version=False)  # bringing engines in: nothing to wait for
    assert "finish_in_flight" not in world.calls


def test_async_updates_do_not_wait_for_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World()
    updater = _updater(world, monkeypatch, mode="async")
    updater.sync(step=0)
    assert "finish_in_flight" not in world.calls


def test_the_plan_is_asked_with_the_bucket_size_in_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    world = World()
    updater = _updater(world, monkeypatch, rollout__sync_bucket_mb=3)
    updater.make_plan()
    assert world.calls == [f"sync_plan {3 * 2**20}"]


def test_the_message_names_the_engine_and_both_checksums_by_their_first_16_digits() -> None:
    engine = "0123456789abcdef" + "9" * 48
    trainer = "fedcba9876543210" + "7" * 48
    with pytest.raises(WeightSyncError) as err:
        check_engine_weights(trainer, 5, [EngineWeights(3, engine, 4)])
    assert str(err.value) == (
        "weight sync verification failed at version 5: engine 3 holds version 4 with checksum "
        "0123456789abcdef; the trainer's checksum is fedcba9876543210"
    )


def test_verify_without_a_version_checks_the_version_the_engines_should_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(held={0: (TRAINER, 0), 1: (TRAINER, 0)})
    updater = _updater(world, monkeypatch)
    updater.verify()  # at start: both sides loaded the same model, version 0
    updater.sync(step=0)
    updater.verify()  # now version 1
    world.held[1] = (TRAINER, 0)  # engine 1 lost the update
    with pytest.raises(WeightSyncError, match="failed at version 1: engine 1 holds version 0"):
        updater.verify()
    assert world.calls.count("weights_dtype") == 1


def test_the_trainers_plan_goes_to_both_sides_of_every_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plan = SyncPlan((Bucket("bfloat16", (TensorMeta("w", (4, 8), "bfloat16"),)),))
    world = World(plan=plan)
    updater = _updater(world, monkeypatch)
    assert updater.plan == SyncPlan() and updater.plan.num_bytes == 0  # nothing planned yet
    updater.make_plan()
    assert updater.plan is plan
    updater.sync(step=0)
    assert [(call, p) for call, p, _ in world.handed] == [
        ("receive", plan),
        ("send_weights", plan),
    ]


def test_a_sync_is_one_span_whose_context_reaches_engines_and_trainers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", provider.get_tracer("miles"))
    for colocated in (False, True):
        world = World()
        _updater(world, monkeypatch, colocated=colocated).sync(step=4)
        (sync_span,) = exporter.get_finished_spans()
        exporter.clear()
        assert sync_span.name == "miles.weight_sync"
        assert dict(sync_span.attributes or {}) == {"step": 5, "version": 1}  # after step 5
        assert [call for call, _, _ in world.handed] == (
            ["send_weights_in_place"] if colocated else ["receive", "send_weights"]
        )
        for _, _, carrier in world.handed:  # the remote sides' spans are children of this one
            parent = trace.get_current_span(propagate.extract(carrier)).get_span_context()
            assert (parent.trace_id, parent.span_id) == (
                sync_span.context.trace_id,
                sync_span.context.span_id,
            )


def test_sync_metrics_time_the_whole_sync_the_transfer_and_the_verification(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(sent_bytes=3 * 10**9, send_s=1.5, checksum_s=0.25)
    updater = _updater(world, monkeypatch)
    metrics = updater.sync(step=0)
    assert metrics == {
        "weights/version": 1.0,
        "weights/sync_bytes": 3e9,
        "perf/sync_s": 1.75,
        "perf/sync_gbps": 2.0,  # 3 GB in 1.5 s
        "perf/sync_verify_s": 0.25,
    }


def test_a_resend_after_failed_verification_is_logged_with_what_the_engine_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(corrupt={1: 1})
    updater = _updater(world, monkeypatch)
    with capture_logs() as logs:
        updater.sync(step=0)
    assert [(e["event"], e["log_level"], e["error"]) for e in logs] == [
        (
            "engines hold other weights than sent; sending again",
            "warning",
            "weight sync verification failed at version 1: engine 1 holds version 1 with "
            "checksum ffffffffffffffff; the trainer's checksum is aaaaaaaaaaaaaaaa",
        )
    ]


def test_each_redone_sync_is_logged_with_its_attempt_and_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = World(fail_sends=2)
    updater = _updater(world, monkeypatch)
    with capture_logs() as logs:
        updater.sync(step=0)
    error = repr(RuntimeError("gloo: connection closed by peer"))
    assert logs == [
        {
            "event": "weight sync failed; redoing it",
            "log_level": "warning",
            "attempt": attempt,
            "error": error,
        }
        for attempt in (1, 2)
    ]
