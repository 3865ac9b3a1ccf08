"""The timeline's bars, from spans: one lane per actor, one bar per stage.

Concurrent spans of one kind on one lane (e.g. hundreds of reward calls) are merged into the
intervals they cover, which draws the same picture with far fewer bars. Long runs show only their
last steps; what was left out is said in `Timeline.notes`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles.report.faults import COUNTERS, Fault
from miles.report.load import RunData, Span
from miles.report.steps import step_of_spans

# span name -> kind of bar. Spans not named here (setup, take, rollout groups) are not drawn.
KINDS: dict[str, str] = {
    "miles.step": "step",
    "miles.warmstart": "warm-start",
    "miles.sft_step": "warm-start",
    "miles.rollout": "rollout",
    "miles.generate": "generate",
    "miles.reward": "reward",
    "miles.train_step": "train",
    "miles.logprobs": "logprobs",
    "miles.weight_sync": "weight sync",
    "miles.checkpoint": "checkpoint",
    "miles.eval": "eval",
}
# Prefix families: miles.weight_sync.send/receive, miles.checkpoint.train, ...
FAMILIES = ("miles.weight_sync", "miles.checkpoint", "miles.eval")
# Spans whose step numbers count as training steps (an end-of-run eval has step = steps).
STEP_SPANS = frozenset({"miles.step", "miles.rollout", "miles.train_step"})
# Kinds drawn inside another bar of the same lane (half height, on top).
INNER = frozenset({"reward", "logprobs"})


@dataclass(frozen=True)
class Bar:
    lane: str
    kind: str
    start_s: float  # seconds from the run start
    end_s: float
    open: bool  # the span had not ended: drawn to the last timestamp seen


@dataclass(frozen=True)
class FaultMark:
    """A fault at its time: a vertical line across the lanes, and a cross on its engine's lane."""

    time_s: float  # seconds from the run start
    kind: str
    lane: str | None  # the failed engine's lane, when it has one


@dataclass
class Timeline:
    lanes: list[str]  # top to bottom
    bars: list[Bar]
    steps: list[tuple[int, float, float]]  # (step, start_s, end_s) of the miles.step spans drawn
    start_s: float
    end_s: float
    open_spans: int
    notes: list[str] = field(default_factory=list)
    marks: list[FaultMark] = field(default_factory=list)


def kind_of(name: str) -> str | None:
    if name in KINDS:
        return KINDS[name]
    for family in FAMILIES:
        if name.startswith(family + "."):
            return KINDS[family]
    return None


def build_timeline(
    run: RunData, faults: Sequence[Fault] = (), max_steps: int = 20, max_bars: int = 3000
) -> Timeline | None:
    """The bars of the last `max_steps` steps (all of a shorter run), in seconds from the start,
    and the faults of that window."""
    drawn = [s for s in run.spans if kind_of(s.name) is not None]
    if not drawn:
        return None
    origin = run_start_ns(run.spans)
    now = max(s.end_ns or s.start_ns for s in run.spans)  # open spans are drawn up to here
    lanes = _lanes(drawn)
    steps = step_of_spans(run.spans)
    cut_ns, notes = _window(drawn, steps, max_steps)

    def seconds(ns: int) -> float:
        return (max(ns, cut_ns or ns) - origin) / 1e9

    shown = [
        (span, span.end_ns if span.end_ns is not None else now)
        for span in drawn
        if cut_ns is None or (span.end_ns or now) > cut_ns
    ]
    if not shown:
        return None
    intervals: dict[tuple[str, str, bool], list[tuple[int, int]]] = defaultdict(list)
    for span, end in shown:
        key = (lanes[span.span_id], kind_of(span.name) or "", span.is_open)
        intervals[key].append((span.start_ns, end))
    # A gap under a fifth of a pixel of the drawn figure (about 1200 px wide) cannot be seen.
    first_ns = max(min(start for spans in intervals.values() for start, _ in spans), cut_ns or 0)
    last_ns = max(end for spans in intervals.values() for _, end in spans)
    gap_ns = (last_ns - first_ns) // 6000
    bars: list[Bar] = []
    for (lane, kind, is_open), spans in intervals.items():
        # Steps stay apart (they abut); other kinds merge, which draws the same picture.
        for start, end in sorted(spans) if kind == "step" else _merge(spans, gap_ns):
            bars.append(Bar(lane, kind, seconds(start), seconds(end), is_open))
    if len(shown) > len(bars):
        notes.append(
            f"{len(shown)} spans drawn as {len(bars)} bars: spans of one kind on one lane that "
            "overlap (or nearly touch) are drawn as one"
        )
    if len(bars) > max_bars:
        bars = sorted(bars, key=lambda b: b.end_s)[-max_bars:]
        notes.append(f"capped at the last {max_bars} bars")
    start_s = min(b.start_s for b in bars)
    setup = [s for s in run.spans if s.name == "miles.setup" and s.end_ns is not None]
    if setup and start_s > 0:
        took = ((setup[0].end_ns or 0) - setup[0].start_ns) / 1e9
        notes.append(f"setup (Ray, actors, model loads) took {took:.1f} s before this")
    open_spans = sum(s.is_open for s in drawn)
    if open_spans:
        notes.append(f"{open_spans} spans still open: drawn hatched up to the last timestamp")
    step_marks = [
        (steps[span.span_id], seconds(span.start_ns), seconds(end))
        for span, end in shown
        if span.name == "miles.step" and span.span_id in steps
    ]
    used = {b.lane for b in bars}
    shown_lanes = [lane for lane in _lane_order(set(lanes.values())) if lane in used]
    marks = [
        FaultMark((f.time_ns - origin) / 1e9, f.kind, _engine_lane(f.engine, shown_lanes))
        for f in faults
        if f.time_ns is not None and f.kind in COUNTERS and f.time_ns >= (cut_ns or origin)
    ]
    timed = sum(f.time_ns is not None and f.kind in COUNTERS for f in faults)
    if timed > len(marks):
        notes.append(f"{timed - len(marks)} faults happened before this window: not drawn")
    return Timeline(
        lanes=shown_lanes,
        bars=bars,
        steps=sorted(step_marks),
        start_s=start_s,
        end_s=max(b.end_s for b in bars),
        open_spans=open_spans,
        notes=notes,
        marks=marks,
    )


def _window(
    drawn: list[Span], steps: dict[str, int], max_steps: int
) -> tuple[int | None, list[str]]:
    """Where the timeline starts when the run has more than `max_steps` steps: at the first span
    of the last `max_steps` of them. None: draw everything."""
    step_ids = sorted(
        {steps[s.span_id] for s in drawn if s.name in STEP_SPANS and steps.get(s.span_id, -1) >= 0}
    )
    if len(step_ids) <= max_steps:
        return None, []
    first = step_ids[-max_steps]
    cut = min(s.start_ns for s in drawn if steps.get(s.span_id, -1) >= first)
    note = (
        f"showing the last {max_steps} of {len(step_ids)} steps (from step {first}); earlier "
        "spans are left out"
    )
    return cut, [note]


def run_start_ns(spans: list[Span]) -> int:
    runs = [s.start_ns for s in spans if s.name == "miles.run"]
    return min(runs) if runs else min(s.start_ns for s in spans)


def _merge(intervals: list[tuple[int, int]], gap_ns: int) -> list[tuple[int, int]]:
    """The union of the intervals, closing gaps of up to `gap_ns` (too narrow to see)."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + gap_ns:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _actor_index(span: Span) -> str | None:
    for key in ("rank", "engine"):
        value = span.attributes.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{key} {value}"
    return None


def _lanes(spans: list[Span]) -> dict[str, str]:
    """span_id -> lane label. A lane is a service (actor); a service whose spans carry several
    ranks or engines (one service name shared by many actors) gets a lane per rank or engine."""
    indices: dict[str, set[str]] = defaultdict(set)
    for span in spans:
        index = _actor_index(span)
        if index is not None:
            indices[span.service].add(index)
    lanes = {}
    for span in spans:
        service = span.service.removeprefix("miles.")
        seen = indices.get(span.service, set())
        index = _actor_index(span)
        if len(seen) > 1 and index is not None:
            lanes[span.span_id] = f"{service} {index}"
        elif len(seen) == 1 and service[-1:].isdigit():
            lanes[span.span_id] = service  # train0 already says rank 0
        elif len(seen) == 1:
            lanes[span.span_id] = f"{service} {next(iter(seen))}"
        else:
            lanes[span.span_id] = service
    return lanes


def _engine_lane(engine: int | None, lanes: list[str]) -> str | None:
    """The lane of engine `engine`: "engine3" (its own actor) or "engine 3" (a shared one)."""
    if engine is None:
        return None
    pattern = re.compile(rf"engine\D*\b{engine}$|engine{engine}$")
    return next((lane for lane in lanes if pattern.search(lane)), None)


def _lane_order(lanes: set[str]) -> list[str]:
    def key(lane: str) -> tuple[int, list[int | str]]:
        rank = next(
            (
                i
                for i, p in enumerate(("controller", "rollout_manager", "engine", "train"))
                if lane.startswith(p)
            ),
            4,
        )
        natural: list[int | str] = [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", lane)]
        return rank, natural

    return sorted(lanes, key=key)
