"""Faults a run survived: engines restarted or dropped, train-group restarts and the steps redone.

Two sources. The `fault` lines of events.jsonl say when, which engine, why and what was restored;
the cumulative `fault/*` counters of metrics.jsonl say by which step it had happened. Events give
each fault its row; a counter that rose with no event line behind it (events.jsonl lost, or a
producer that writes only counters) still counts, and gets a row of its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from miles.report.load import FaultEvent, RunData
from miles.report.steps import step_of_spans

ENGINE_RESTART = "engine restart"
ENGINE_DROPPED = "engine dropped"
TRAIN_RESTART = "train restart"
ENGINE_FAILED = "engine failed"  # a failure with no restart or drop (yet): listed, not counted

# event `fault` value -> kind
EVENT_KINDS = {
    "engine_restarted": ENGINE_RESTART,
    "engine_dropped": ENGINE_DROPPED,
    "train_restarted": TRAIN_RESTART,
    "engine_failed": ENGINE_FAILED,
}
# The kinds a run survives, in the order the header lists them, with their counter.
COUNTERS = {
    ENGINE_RESTART: "fault/engine_restarts",
    TRAIN_RESTART: "fault/train_restarts",
    ENGINE_DROPPED: "fault/engines_dropped",
}
STEPS_REDONE = "fault/steps_redone"
PLURALS = {ENGINE_RESTART: "engine restarts", TRAIN_RESTART: "train restarts"}
PLURALS[ENGINE_DROPPED] = "engines dropped"


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int | None  # the step it happened in; None: not known (shown on the timeline only)
    time_ns: int | None  # None: known from a counter only
    timestamp: str  # as logged; "" for a fault known from a counter only
    actor: str
    detail: str  # what failed and what was done
    engine: int | None = None
    steps_redone: int = 0


@dataclass(frozen=True)
class StepMark:
    """A vertical marker on the curves: `count` faults of `kind` at `step`."""

    step: int
    kind: str
    count: int


@dataclass(frozen=True)
class RedoBand:
    """Steps trained again after a train restart, shaded on the curves from `first` to `last`."""

    first: int
    last: int  # the step that failed
    steps: int


@dataclass
class Faults:
    faults: list[Fault]  # one table row each, in time order
    counts: dict[str, int]  # survived kind -> how many, the larger of events and counters
    steps_redone: int
    notes: list[str] = field(default_factory=list)

    @property
    def survived(self) -> int:
        return sum(self.counts.values())

    @property
    def marks(self) -> list[StepMark]:
        found = Counter((f.step, f.kind) for f in self.faults if f.step is not None)
        return [
            StepMark(step, kind, n)
            for (step, kind), n in sorted(found.items())
            if kind in COUNTERS  # a failure still pending is in the table, not on the curves
        ]

    @property
    def bands(self) -> list[RedoBand]:
        return [
            RedoBand(f.step - f.steps_redone, f.step, f.steps_redone)
            for f in self.faults
            if f.kind == TRAIN_RESTART and f.step is not None and f.steps_redone > 0
        ]

    def summary(self) -> str:
        """E.g. "2 engine restarts, 1 train restart (3 steps redone), 1 engine dropped"."""
        parts = []
        for kind, n in self.counts.items():
            if n == 0:
                continue
            label = f"{n} {kind if n == 1 else PLURALS[kind]}"
            if kind == TRAIN_RESTART and self.steps_redone:
                label += f" ({_plural(self.steps_redone, 'step')} redone)"
            parts.append(label)
        return ", ".join(parts) or "none"


def collect_faults(run: RunData) -> Faults:
    """Every fault of the run, with the step it happened in where that can be told."""
    locate = _step_locator(run)
    rows = _pair_engine_events(run.faults, locate)
    counters = {kind: _counter_steps(run, key) for kind, key in COUNTERS.items()}
    notes: list[str] = []
    counts: dict[str, int] = {}
    for kind, reached in counters.items():
        logged = [r for r in rows if r.kind == kind]
        counts[kind] = max(len(logged), len(reached))
        if not logged:
            rows += _from_counter(run, kind, reached)
        elif len(logged) < len(reached):
            notes.append(
                f"{COUNTERS[kind]} counts {len(reached)} but events.jsonl has {len(logged)} "
                f"{kind} lines: the table lists only those"
            )
        # The k-th fault of a kind happened by the step at which its counter first reached k.
        rows = [
            replace(r, step=reached[i])
            if r.kind == kind and r.step is None and i < len(reached)
            else r
            for i, r in _ordinals(rows, kind)
        ]
    redone_events = sum(r.steps_redone for r in rows if r.kind == TRAIN_RESTART)
    redone = max(redone_events, int(_last_counter(run, STEPS_REDONE)))
    rows.sort(
        key=lambda r: (r.time_ns is None, r.time_ns or 0, r.step if r.step is not None else -1)
    )
    return Faults(rows, counts, redone, notes)


# ── events to rows ───────────────────────────────────────────────────────────────────────────────


def _pair_engine_events(
    events: list[FaultEvent], locate: Callable[[FaultEvent], int | None]
) -> list[Fault]:
    """One row per restart, drop and train restart; an engine's failure is folded into the
    restart or drop that follows it, and listed alone only if none does."""
    rows: list[Fault] = []
    pending: dict[int | None, FaultEvent] = {}  # engine -> its failure not yet acted on
    for event in events:
        kind = EVENT_KINDS.get(event.kind)
        engine = _int(event.fields.get("engine"))
        if kind == ENGINE_FAILED:
            if engine in pending:  # failed again before it was acted on: keep both
                rows.append(_failure_row(pending[engine], locate))
            pending[engine] = event
        elif kind in (ENGINE_RESTART, ENGINE_DROPPED):
            rows.append(_engine_row(event, kind, pending.pop(engine, None), locate))
        elif kind == TRAIN_RESTART:
            rows.append(_train_row(event, locate))
        else:  # a kind this report does not know yet: listed as logged, not counted
            detail = str(event.fields.get("event", ""))
            name = event.kind.replace("_", " ")
            rows.append(
                Fault(name, locate(event), event.time_ns, event.timestamp, event.actor, detail)
            )
    rows += [_failure_row(event, locate) for event in pending.values()]
    return rows


def _engine_row(
    event: FaultEvent,
    kind: str,
    failure: FaultEvent | None,
    locate: Callable[[FaultEvent], int | None],
) -> Fault:
    engine = _int(event.fields.get("engine"))
    reason = event.fields.get("reason") or (failure.fields.get("reason") if failure else None)
    failed = f"engine {_or_q(engine)} failed" + (f" ({reason})" if reason else "")
    if kind == ENGINE_RESTART:
        done = "restarted; it serves again"
    else:
        done = "dropped (past fault.max_engine_restarts); the run goes on with the other engines"
    step = locate(event)
    if step is None and failure is not None:
        step = locate(failure)
    return Fault(
        kind, step, event.time_ns, event.timestamp, event.actor, f"{failed}; {done}", engine
    )


def _failure_row(event: FaultEvent, locate: Callable[[FaultEvent], int | None]) -> Fault:
    engine = _int(event.fields.get("engine"))
    reason = event.fields.get("reason")
    detail = f"engine {_or_q(engine)} failed" + (f" ({reason})" if reason else "")
    detail += "; no restart or drop logged after it"
    return Fault(
        ENGINE_FAILED, locate(event), event.time_ns, event.timestamp, event.actor, detail, engine
    )


def _train_row(event: FaultEvent, locate: Callable[[FaultEvent], int | None]) -> Fault:
    step = locate(event)
    redone = _int(event.fields.get("steps_redone")) or 0
    restored = event.fields.get("restored")
    at = f" at step {step}" if step is not None else ""
    detail = f"the train group failed{at}; restarted from {restored or 'its latest state'}"
    detail += f", {_plural(redone, 'step')} redone"
    return Fault(
        TRAIN_RESTART, step, event.time_ns, event.timestamp, event.actor, detail, None, redone
    )


def _from_counter(run: RunData, kind: str, reached: list[int]) -> list[Fault]:
    """Rows for faults only a counter knows of: one per unit the counter rose, at that step."""
    key = COUNTERS[kind]
    redone = _counter_deltas(run, STEPS_REDONE) if kind == TRAIN_RESTART else {}
    rows = []
    for step in reached:
        n = redone.pop(step, 0)  # the steps redone go with the first restart of the step
        detail = f"{key} rose at step {step}; no event line says more"
        if n:
            detail += f" ({_plural(n, 'step')} redone)"
        rows.append(Fault(kind, step, None, "", "-", detail, None, n))
    return rows


# ── where a fault happened ───────────────────────────────────────────────────────────────────────


def _step_locator(run: RunData) -> Callable[[FaultEvent], int | None]:
    """The step an event happened in: its own `step` key, else the step of the span it was
    logged in, else the controller's `miles.step` span whose time holds it."""
    span_steps = step_of_spans(run.spans)
    now = max((s.end_ns or s.start_ns for s in run.spans), default=0)
    windows = sorted(
        (s.start_ns, s.end_ns or now, step)
        for s in run.spans
        if s.name == "miles.step" and (step := _int(s.attributes.get("step"))) is not None
    )

    def locate(event: FaultEvent) -> int | None:
        own = _int(event.fields.get("step"))
        if own is not None:
            return own
        if event.span_id is not None and event.span_id in span_steps:
            return span_steps[event.span_id]
        t = event.time_ns
        if t is None:
            return None
        return next((step for start, end, step in windows if start <= t <= end), None)

    return locate


def _counter_steps(run: RunData, key: str) -> list[int]:
    """The step at which the cumulative counter reached 1, 2, 3, ... (index k-1 for k)."""
    reached: list[int] = []
    for step, n in sorted(_counter_deltas(run, key).items()):
        reached += [step] * n
    return reached


def _counter_deltas(run: RunData, key: str) -> dict[int, int]:
    """step -> how much the cumulative counter rose at that step (absent: 0, as in older runs)."""
    deltas: dict[int, int] = {}
    high = 0
    for step, metrics in run.steps.items():
        value = int(metrics.get(key, 0))
        if value > high:  # a resumed run may log a lower value again: count only new highs
            deltas[step] = value - high
            high = value
    return deltas


def _last_counter(run: RunData, key: str) -> float:
    return max((m.get(key, 0.0) for m in run.steps.values()), default=0.0)


def _ordinals(rows: list[Fault], kind: str) -> Iterable[tuple[int, Fault]]:
    """Each row with its 0-based rank among the rows of `kind` (in log order; -1 for others)."""
    n = 0
    for row in rows:
        if row.kind == kind:
            yield n, row
            n += 1
        else:
            yield -1, row


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


def _or_q(value: int | None) -> str:
    return "?" if value is None else str(value)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
