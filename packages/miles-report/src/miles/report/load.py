"""Reads a run directory, finished or still being written.

A run appends to its files while it goes, so a reader may see a last line cut in half, a
`traces.jsonl` or `events.jsonl` not created yet, or a span still open (no `end_ns`). None of these
is an error here: what cannot be read is skipped and said in `RunData.notes`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import yaml


class NotARunError(Exception):
    """The directory holds neither config.yaml nor metrics.jsonl."""


@dataclass(frozen=True)
class Span:
    name: str
    span_id: str
    parent_id: str | None
    start_ns: int
    end_ns: int | None  # None: still open when the file was read
    status: str
    service: str
    attributes: Mapping[str, Any]

    @property
    def is_open(self) -> bool:
        return self.end_ns is None


@dataclass(frozen=True)
class Event:
    """One warning or error line of events.jsonl."""

    level: str
    message: str
    timestamp: str
    actor: str


@dataclass(frozen=True)
class FaultEvent:
    """One line of events.jsonl with a `fault` key: a failure and what the run did about it."""

    kind: str  # engine_failed, engine_restarted, engine_dropped, train_restarted
    timestamp: str
    time_ns: int | None  # the timestamp as epoch ns, on the clock of the spans
    actor: str
    span_id: str | None  # the span the line was logged in, if any
    fields: Mapping[str, Any]  # engine, reason, step, restored, steps_redone, ...


@dataclass
class RunData:
    run_dir: Path
    config: dict[str, Any]
    manifest: dict[str, Any]
    steps: dict[int, dict[str, float]]  # step -> its metrics; rows of one step merged
    spans: list[Span]
    has_traces: bool
    event_lines: int
    problems: list[Event]  # warnings and errors, in file order
    last_write: float | None  # newest mtime of the run's files (epoch seconds)
    notes: list[str] = field(default_factory=list)
    faults: list[FaultEvent] = field(default_factory=list)  # in file order
    # The "run interrupted" event of the latest start (Ctrl-C), if it has one.
    interrupted: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        name = self.config.get("name")
        return name if isinstance(name, str) and name else self.run_dir.name

    @property
    def steps_planned(self) -> int | None:
        steps = self.config.get("steps")
        return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


@dataclass(frozen=True)
class JsonLines:
    rows: list[dict[str, Any]]
    bad_lines: list[int]  # 1-based numbers of lines that were not a JSON object
    cut_last: bool  # the last line had no newline and did not parse: a write in progress


def read_jsonl(path: Path) -> JsonLines:
    """Every JSON object of a JSON-lines file; bad lines are skipped and counted."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return JsonLines([], [], False)
    lines = text.split("\n")
    rows: list[dict[str, Any]] = []
    bad: list[int] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad.append(number)
    # split() leaves "" after a final newline, so a cut last line is the last element.
    cut = bool(bad) and bad[-1] == len(lines) and lines[-1].strip() != ""
    return JsonLines(rows, bad, cut)


def load_run(run_dir: Path) -> RunData:
    """Everything the report needs from `run_dir`; raises NotARunError if it is not a run."""
    if not (run_dir / "config.yaml").is_file() and not (run_dir / "metrics.jsonl").is_file():
        raise NotARunError(
            f"{run_dir} is not a Miles run directory: it has neither config.yaml nor "
            "metrics.jsonl (give the --run-dir of a `miles run`)"
        )
    notes: list[str] = []
    config = _read_mapping(run_dir / "config.yaml", notes, yaml_file=True)
    manifest = _read_mapping(run_dir / "manifest.json", notes, yaml_file=False)

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    _note_skipped("metrics.jsonl", metrics, notes)
    if not (run_dir / "metrics.jsonl").exists():
        notes.append("metrics.jsonl does not exist yet: no step has finished")
    steps = _merge_steps(metrics.rows)

    traces_path = run_dir / "traces.jsonl"
    traces = read_jsonl(traces_path)
    _note_skipped("traces.jsonl", traces, notes)
    if not traces_path.exists():
        notes.append("traces.jsonl is missing: no timeline, and step costs come from metrics only")
    spans = [s for s in (_span(row) for row in traces.rows) if s is not None]
    if len(spans) < len(traces.rows):
        notes.append(f"traces.jsonl: {len(traces.rows) - len(spans)} lines are not spans; skipped")

    events = read_jsonl(run_dir / "events.jsonl")
    _note_skipped("events.jsonl", events, notes)
    problems = [e for e in (_problem(row) for row in events.rows) if e is not None]
    faults = [f for f in (_fault(row) for row in events.rows) if f is not None]

    mtimes = [
        p.stat().st_mtime
        for p in (run_dir / n for n in ("metrics.jsonl", "traces.jsonl", "events.jsonl"))
        if p.exists()
    ]
    return RunData(
        run_dir=run_dir,
        config=config,
        manifest=manifest,
        steps=steps,
        spans=spans,
        has_traces=traces_path.exists(),
        event_lines=len(events.rows),
        problems=problems,
        last_write=max(mtimes) if mtimes else None,
        notes=notes,
        faults=faults,
        interrupted=_interrupted(events.rows),
    )


def _interrupted(rows: list[dict[str, Any]]) -> Mapping[str, Any] | None:
    """The last "run interrupted" event, unless the run was started (resumed) again after it."""
    found = None
    for row in rows:
        if row.get("event") == "run started":
            found = None
        elif row.get("event") == "run interrupted":
            found = row
    return found


def seconds_since(epoch_s: float | None) -> float | None:
    return None if epoch_s is None else max(time.time() - epoch_s, 0.0)


def _read_mapping(path: Path, notes: list[str], *, yaml_file: bool) -> dict[str, Any]:
    if not path.exists():
        notes.append(f"{path.name} is missing")
        return {}
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text) if yaml_file else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        notes.append(f"{path.name} could not be read ({type(exc).__name__}); ignored")
        return {}
    return data if isinstance(data, dict) else {}


def _note_skipped(name: str, read: JsonLines, notes: list[str]) -> None:
    if read.cut_last:
        notes.append(f"{name}: the last line is incomplete (still being written); skipped")
    others = len(read.bad_lines) - int(read.cut_last)
    if others:
        notes.append(f"{name}: {others} malformed lines skipped")


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _merge_steps(rows: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """One dict per step; a later row of the same step (e.g. the end-of-run eval) adds to it."""
    steps: dict[int, dict[str, float]] = {}
    for row in rows:
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            continue
        merged = steps.setdefault(step, {})
        for key, value in row.items():
            number = _number(value)
            if key != "step" and number is not None:
                merged[key] = number
    return dict(sorted(steps.items()))


def _span(row: dict[str, Any]) -> Span | None:
    name, start = row.get("name"), row.get("start_ns")
    if not isinstance(name, str) or not isinstance(start, int):
        return None
    end = row.get("end_ns")
    resource = row.get("resource")
    service = resource.get("service.name") if isinstance(resource, dict) else None
    attributes = row.get("attributes")
    parent = row.get("parent_span_id")
    return Span(
        name=name,
        span_id=str(row.get("span_id") or ""),
        parent_id=parent if isinstance(parent, str) else None,
        start_ns=start,
        end_ns=end if isinstance(end, int) and end >= start else None,
        status=str(row.get("status") or "UNSET"),
        service=service if isinstance(service, str) else "unknown",
        attributes=attributes if isinstance(attributes, dict) else {},
    )


_PROBLEM_LEVELS = {"warning", "error", "critical", "exception"}


def _problem(row: dict[str, Any]) -> Event | None:
    level = str(row.get("level", "")).lower()
    if level not in _PROBLEM_LEVELS:
        return None
    return Event(
        level=level,
        message=str(row.get("event", "")),
        timestamp=str(row.get("timestamp", "")),
        actor=str(row.get("actor", "controller")),
    )


def _fault(row: dict[str, Any]) -> FaultEvent | None:
    kind = row.get("fault")
    if not isinstance(kind, str) or not kind:
        return None
    timestamp = str(row.get("timestamp", ""))
    span_id = row.get("span_id")
    return FaultEvent(
        kind=kind,
        timestamp=timestamp,
        time_ns=_epoch_ns(timestamp),
        actor=str(row.get("actor", "controller")),
        span_id=span_id if isinstance(span_id, str) else None,
        fields=row,
    )


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _epoch_ns(timestamp: str) -> int | None:
    """structlog's ISO timestamp (UTC, "Z") as epoch nanoseconds; None if it is not one."""
    try:
        moment = datetime.fromisoformat(timestamp)
    except ValueError:
        return None
    if moment.tzinfo is None:  # structlog writes UTC; a naive stamp is taken as UTC too
        moment = moment.replace(tzinfo=UTC)
    return (moment - _EPOCH) // timedelta(microseconds=1) * 1000  # exact, unlike a float
