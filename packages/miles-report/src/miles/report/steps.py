"""Per-step numbers: run status, metric series, where each step's time went."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from miles.report.load import RunData, Span, seconds_since

State = Literal["finished", "failed", "interrupted", "running"]


@dataclass(frozen=True)
class RunStatus:
    state: State
    steps_done: int
    steps_planned: int | None
    detail: str


def training_steps(run: RunData) -> list[int]:
    """Steps that trained: a row holding only eval/* keys is an evaluation, not a step."""
    return [s for s, m in run.steps.items() if any(not k.startswith("eval/") for k in m)]


def run_status(run: RunData) -> RunStatus:
    """Finished when the `miles.run` span closed after everything else (a resumed run opens a new
    one); without traces, when the metrics reach config `steps`."""
    done = training_steps(run)
    planned = run.steps_planned
    all_done = planned is not None and len(done) > 0 and len(done) >= planned
    runs = [s for s in run.spans if s.name == "miles.run" and s.end_ns is not None]
    last_start = max((s.start_ns for s in run.spans), default=0)
    final = max(runs, key=lambda s: s.start_ns, default=None)
    if run.interrupted is not None:
        done_n = run.interrupted.get("steps_done", len(done))
        saved = run.interrupted.get("checkpoint")
        what = f"a checkpoint of it is {saved}" if saved else "no checkpoint was saved"
        return RunStatus(
            "interrupted",
            len(done),
            planned,
            f"stopped by Ctrl-C after step {done_n}; {what} (miles run --resume continues it)",
        )
    if final is not None and final.end_ns is not None and final.end_ns >= last_start:
        seconds = (final.end_ns - final.start_ns) / 1e9
        if final.status == "ERROR":
            return RunStatus(
                "failed",
                len(done),
                planned,
                f"the run ended with an error (or was stopped) after {seconds:.1f} s",
            )
        return RunStatus(
            "finished", len(done), planned, f"the run span closed after {seconds:.1f} s"
        )
    if all_done and not run.has_traces:
        return RunStatus("finished", len(done), planned, "every planned step is in metrics.jsonl")
    ago = seconds_since(run.last_write)
    since = f"; last write {_duration(ago)} ago" if ago is not None else ""
    if all_done:
        detail = "every planned step is logged; the run is finishing (checkpoint, eval)"
    else:
        detail = f"{len(done)} of {planned if planned is not None else '?'} steps logged"
    if ago is not None and ago > 1800:
        detail += " (no writes for a while: it may have stopped without closing its files)"
    return RunStatus("running", len(done), planned, detail + since)


def series(run: RunData, key: str) -> tuple[list[int], list[float]]:
    pairs = [(s, m[key]) for s, m in run.steps.items() if key in m]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def last_value(run: RunData, key: str) -> tuple[int, float] | None:
    for step in reversed(run.steps):
        if key in run.steps[step]:
            return step, run.steps[step][key]
    return None


def mean(run: RunData, key: str) -> float | None:
    values = series(run, key)[1]
    return statistics.fmean(values) if values else None


# ── where a step's time went ─────────────────────────────────────────────────────────────────────

# Parts of a step, with the metric that holds each and the spans to use where the metric is absent.
# perf/step_s covers rollout wait + train + sync (+ an eval due that step); the controller takes a
# checkpoint after the step, so its time is added on top: the run waited for it all the same.
PARTS: tuple[tuple[str, str | None, tuple[str, ...]], ...] = (
    ("rollout wait", "perf/rollout_wait_s", ("miles.take",)),
    ("train", "perf/train_s", ("miles.train_step",)),
    ("weight sync", "perf/sync_s", ("miles.weight_sync",)),
    ("eval", None, ("miles.eval",)),
    ("checkpoint", None, ("miles.checkpoint",)),
)


@dataclass(frozen=True)
class StepCost:
    step: int
    seconds: float  # perf/step_s plus the checkpoint written after the step
    parts: dict[str, float]  # name -> seconds; "other" holds what no part explains
    from_spans: tuple[str, ...]  # parts read from spans because metrics lacked them
    cause: str  # the part most above its own median over the run
    cause_excess_s: float
    median_s: float  # median step time of the run

    @property
    def above_median_s(self) -> float:
        return self.seconds - self.median_s


def step_of_spans(spans: Iterable[Span]) -> dict[str, int]:
    """span_id -> step: a span's own `step` attribute, else its nearest ancestor's."""
    by_id = {s.span_id: s for s in spans}
    found: dict[str, int | None] = {}

    def lookup(span_id: str) -> int | None:
        path: list[str] = []  # spans without a step of their own, up to the first that has one
        current: str | None = span_id
        while current in by_id and current not in found and current not in path:
            step = _step_attr(by_id[current])
            if step is not None:
                found[current] = step
                break
            path.append(current)
            current = by_id[current].parent_id
        result = found.get(current) if current is not None else None
        for sid in path:
            found[sid] = result
        return result

    return {s.span_id: step for s in by_id.values() if (step := lookup(s.span_id)) is not None}


def step_costs(run: RunData) -> list[StepCost]:
    """Every training step's time, split into parts, with the part that made it slow."""
    span_seconds = _span_seconds_by_step(run.spans)
    rows: list[tuple[int, float, dict[str, float], tuple[str, ...]]] = []
    for step in training_steps(run):
        metrics, spans = run.steps[step], span_seconds.get(step, {})
        step_s = metrics.get("perf/step_s", spans.get("miles.step"))
        if step_s is None:
            continue
        parts: dict[str, float] = {}
        from_spans: list[str] = []
        for part, key, names in PARTS:
            if key is not None and key in metrics:
                parts[part] = metrics[key]
                continue
            found = [spans[n] for n in names if n in spans]
            parts[part] = max(found, default=0.0)
            if found:
                from_spans.append(part)
        total = step_s + parts["checkpoint"]
        parts["other"] = max(total - sum(parts.values()), 0.0)
        rows.append((step, total, parts, tuple(from_spans)))
    if not rows:
        return []
    median_s = statistics.median(r[1] for r in rows)
    part_medians = {p: statistics.median(r[2][p] for r in rows) for p in rows[0][2]}
    costs = []
    for step, total, split, sources in rows:
        excess = {p: v - part_medians[p] for p, v in split.items()}
        cause = max(excess, key=lambda p: excess[p])
        if excess[cause] <= 0:  # nothing above its usual: name the biggest part instead
            cause = max(split, key=lambda p: split[p])
        costs.append(StepCost(step, total, split, sources, cause, excess[cause], median_s))
    return costs


def slowest(costs: list[StepCost], n: int = 5) -> list[StepCost]:
    return sorted(costs, key=lambda c: (-c.seconds, c.step))[:n]


def _span_seconds_by_step(spans: list[Span]) -> dict[int, dict[str, float]]:
    """step -> span name -> the longest closed span of that name in the step (ranks run at once)."""
    steps = step_of_spans(spans)
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for span in spans:
        step = steps.get(span.span_id)
        if step is None or span.end_ns is None:
            continue
        seconds = (span.end_ns - span.start_ns) / 1e9
        by_name = out[step]
        by_name[span.name] = max(by_name.get(span.name, 0.0), seconds)
    return out


def _step_attr(span: Span) -> int | None:
    step = span.attributes.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
