"""The report page: one HTML file, figures inline as data URIs, no script, no external asset."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from html import escape
from typing import Any

from miles.report.faults import Faults
from miles.report.figures import FAULT_STYLES, REDONE_COLOR, CurveGroup
from miles.report.load import RunData
from miles.report.steps import PARTS, RunStatus, StepCost, last_value, mean
from miles.report.timeline import Timeline, run_start_ns


@dataclass
class Report:
    run: RunData
    status: RunStatus
    curves: list[tuple[CurveGroup, bytes]]  # drawn, in page order
    missing: list[CurveGroup]  # nothing of the group was logged
    timeline: Timeline | None
    timeline_png: bytes | None
    idle_png: bytes | None
    costs: list[StepCost]
    slowest: list[StepCost]
    faults: Faults


# (metric, label) of the header's "last values" table
LAST_VALUES = (
    ("rollout/reward_mean", "reward (rollout)"),
    ("eval/reward_mean", "reward (eval)"),
    ("rollout/response_len_mean", "response length"),
    ("train/loss", "loss"),
    ("train/ppo_kl", "KL policy vs old"),
    ("train/rollout_kl", "KL trainer vs engine"),
    ("train/kl_ref", "KL vs reference"),
    ("train/rollout_logprob_abs_diff", "logprob mismatch"),
    ("perf/tokens_per_s", "tokens/s"),
    ("perf/step_s", "step time (s)"),
    ("perf/trainer_idle_frac", "trainer idle"),
    ("perf/rollout_idle_frac", "rollout idle"),
    ("weights/version", "weight version"),
)

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222;
       margin: 0; background: #fff; }
main { max-width: 1320px; margin: 0 auto; padding: 16px 24px 48px; }
h1 { font-size: 24px; margin: 8px 0 2px; }
h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #666; margin: 0 0 12px; font-family: ui-monospace, monospace; font-size: 12px; }
.badge { display: inline-block; padding: 1px 10px; border-radius: 10px; font-weight: 600;
         font-size: 13px; vertical-align: middle; }
.finished { background: #dcefdc; color: #1d5e1d; }
.failed { background: #f6d5d5; color: #8a1c1c; }
.running { background: #fbecc8; color: #7a5300; }
.interrupted { background: #ececec; color: #444; }
.survived { background: #dde8f5; color: #1f4e79; }
.cols { display: flex; gap: 32px; flex-wrap: wrap; align-items: flex-start; }
table { border-collapse: collapse; font-size: 13px; }
th, td { text-align: left; padding: 3px 10px 3px 0; border-bottom: 1px solid #eee;
         vertical-align: top; }
th { color: #555; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(600px, 1fr)); gap: 12px; }
figure { margin: 0; }
figure img { max-width: 100%; height: auto; display: block; }
figcaption { color: #666; font-size: 12px; }
.notes { background: #f7f7f7; border-left: 3px solid #bbb; padding: 6px 12px; margin: 10px 0;
         font-size: 13px; }
.notes ul { margin: 4px 0; padding-left: 18px; }
.cause { font-weight: 600; }
footer { color: #888; font-size: 12px; margin-top: 36px; }
"""


def render(report: Report) -> str:
    body = [
        _header(report),
        _curves(report),
        _timeline(report),
        _faults(report),
        _idle(report),
        _slowest(report),
        _problems(report.run),
        f"<footer>Written by <code>miles report</code> at {escape(_now())}. "
        "Self-contained: figures are embedded; the PNG files beside this page are the same."
        "</footer>",
    ]
    title = f"Miles report: {report.run.name}"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{escape(title)}</title><style>{CSS}</style></head>\n"
        f"<body><main>\n{''.join(body)}\n</main></body></html>\n"
    )


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1e4:
        return f"{value:,.0f}"
    return f"{value:.4g}"


# ── sections ─────────────────────────────────────────────────────────────────────────────────────


def _header(report: Report) -> str:
    run, status = report.run, report.status
    planned = status.steps_planned
    steps = f"{status.steps_done} of {planned}" if planned is not None else str(status.steps_done)
    facts: list[tuple[str, str]] = [
        ("status", f"{status.state}: {status.detail}"),
        ("steps done", steps),
        (_faults_label(report), report.faults.summary()),
        ("run id", str(run.manifest.get("run_id", "-"))),
        ("started", str(run.manifest.get("created", "-"))),
        ("mode", _get(run.config, "mode", "placement", sep=" / ")),
        ("model", _get(run.config, "model.path")),
        ("algorithm", _get(run.config, "algorithm.advantage.name", "algorithm.loss.name")),
        ("layout", _layout(run.config)),
        ("reward", _get(run.config, "reward.name")),
    ]
    fact_rows = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in facts)
    last_rows = ""
    for key, label in LAST_VALUES:
        found = last_value(run, key)
        if found is not None:
            last_rows += (
                f"<tr><th title='{escape(key)}'>{escape(label)}</th>"
                f"<td class='num'>{fmt(found[1])}</td><td>step {found[0]}</td></tr>"
            )
    last = (
        f"<div><h3>Last values</h3><table>{last_rows}</table></div>"
        if last_rows
        else "<div><h3>Last values</h3><p>No metrics yet.</p></div>"
    )
    missing = report.missing if run.steps else []  # before the first step, nothing is missing
    notes = run.notes + [
        f"not logged in this run: {g.title} ({', '.join(c.key for c in g.curves)})" for g in missing
    ]
    style, badge = _badge(report)
    return (
        f"<h1>{escape(run.name)} <span class='badge {style}'>{escape(badge)}</span>"
        f"</h1><p class='sub'>{escape(str(run.run_dir.resolve()))}</p>"
        f"<div class='cols'><div><h3>Run</h3><table>{fact_rows}</table></div>{last}</div>"
        + _notes(notes)
    )


def _curves(report: Report) -> str:
    if not report.curves:
        return "<h2>Curves</h2><p>No step metrics yet.</p>"
    figures = "".join(
        _figure(png, group.title, f"{group.name}.png: " + ", ".join(c.key for c in group.curves))
        for group, png in report.curves
    )
    return f"<h2>Curves</h2><div class='grid'>{figures}</div>"


def _timeline(report: Report) -> str:
    head = "<h2>Timeline</h2>"
    if report.timeline is None or report.timeline_png is None:
        why = "traces.jsonl is missing" if not report.run.has_traces else "no stage has ended yet"
        return head + f"<p>No timeline: {why}.</p>"
    caption = (
        "timeline.png: bars are spans from traces.jsonl, coloured by stage; the grey band is the "
        "controller's step, numbered"
    )
    return head + _figure(report.timeline_png, "timeline", caption) + _notes(report.timeline.notes)


def _faults(report: Report) -> str:
    head = "<h2 id='faults'>Faults</h2>"
    faults = report.faults
    if not faults.faults:
        return head + (
            "<p>None: no engine failed, was restarted or dropped, and the train group was never "
            "restarted.</p>"
        )
    origin = run_start_ns(report.run.spans) if report.run.spans else None
    rows = "".join(
        f"<tr><td>{escape(f.timestamp or '-')}</td>"
        f"<td class='num'>{_since(f.time_ns, origin)}</td>"
        f"<td class='num'>{'-' if f.step is None else f.step}</td>"
        f"<td>{_swatch(f.kind)}{escape(f.kind)}</td><td>{escape(f.actor)}</td>"
        f"<td>{escape(f.detail)}</td></tr>"
        for f in faults.faults
    )
    caption = (
        "<p class='sub' style='font-family:inherit'>From the <code>fault</code> lines of "
        "events.jsonl and the <code>fault/*</code> counters of metrics.jsonl. The curves mark "
        "each fault at its step (dashed: engine restart, solid: train restart, dotted: engine "
        f"dropped) and shade the steps redone ({_swatch('redone').strip()}); the timeline marks it at its "
        "time. Step <i>-</i>: the step could not be told (no step span holds the time), so it "
        "is on the timeline only. An engine failure is folded into the restart or drop after "
        "it.</p>"
    )
    return (
        head + caption + "<table><tr><th>time</th><th>s from start</th><th>step</th>"
        f"<th>kind</th><th>actor</th><th>what happened</th></tr>{rows}</table>"
        + _notes(faults.notes)
    )


def _idle(report: Report) -> str:
    run = report.run
    rows: list[tuple[str, float | None, str]] = [
        ("trainer idle (mean)", mean(run, "perf/trainer_idle_frac"), "%"),
        ("rollout idle (mean)", mean(run, "perf/rollout_idle_frac"), "%"),
        ("step time (mean)", mean(run, "perf/step_s"), "s"),
        ("rollout wait (mean)", mean(run, "perf/rollout_wait_s"), "s"),
        ("train (mean)", mean(run, "perf/train_s"), "s"),
        ("weight sync (mean)", mean(run, "perf/sync_s"), "s"),
        ("rollout generating (mean)", mean(run, "perf/rollout_s"), "s"),
    ]
    cells = "".join(
        f"<tr><th>{escape(label)}</th><td class='num'>"
        f"{f'{100 * value:.1f} %' if unit == '%' else f'{value:.3f} s'}</td></tr>"
        for label, value, unit in rows
        if value is not None
    )
    table = f"<table>{cells}</table>" if cells else "<p>No perf metrics logged.</p>"
    explain = (
        "<p class='sub' style='font-family:inherit'>trainer idle: the share of a step the trainer "
        "was not training (1 − train_s / step_s); rollout idle: the share of wall time the engines "
        "had no request.</p>"
    )
    figure = (
        _figure(report.idle_png, "idle", "idle.png: perf/trainer_idle_frac, perf/rollout_idle_frac")
        if report.idle_png is not None
        else "<p>perf/trainer_idle_frac and perf/rollout_idle_frac are not logged.</p>"
    )
    return (
        f"<h2>Idle time</h2><div class='cols'><div>{figure}</div>"
        f"<div style='max-width:520px'>{table}{explain}</div></div>"
    )


def _slowest(report: Report) -> str:
    head = "<h2>Slowest steps</h2>"
    if not report.slowest:
        return head + "<p>No step times yet (perf/step_s or miles.step spans).</p>"
    parts = [p[0] for p in PARTS] + ["other"]
    header = "".join(f"<th>{escape(p)} (s)</th>" for p in parts)
    rows = []
    for cost in report.slowest:
        cells = "".join(
            f"<td class='num{' cause' if p == cost.cause else ''}'>{cost.parts.get(p, 0.0):.3f}"
            f"{'*' if p in cost.from_spans else ''}</td>"
            for p in parts
        )
        ratio = cost.seconds / cost.median_s if cost.median_s > 0 else float("inf")
        vs = f"{cost.above_median_s:+.3f} s ({ratio:.2f}× median)"
        rows.append(
            f"<tr><td class='num'>{cost.step}</td><td class='num'>{cost.seconds:.3f}</td>"
            f"<td class='num'>{escape(vs)}</td><td class='cause'>{escape(_why(cost))}</td>"
            f"{cells}</tr>"
        )
    median = report.slowest[0].median_s
    caption = (
        f"<p class='sub' style='font-family:inherit'>Top {len(rows)} of {len(report.costs)} "
        f"steps by time; the median step took {median:.3f} s. Step time is perf/step_s plus the "
        "checkpoint written after that step (the controller takes it between steps). <b>Slow "
        "because</b> names the part most above its own median over the run. Parts marked * come "
        "from the step's spans, the metrics lacking them.</p>"
    )
    return (
        head + caption + "<table><tr><th>step</th><th>time (s)</th><th>vs median</th>"
        f"<th>slow because</th>{header}</tr>{''.join(rows)}</table>"
    )


def _problems(run: RunData) -> str:
    head = "<h2>Warnings and errors</h2>"
    if not run.problems:
        lines = (
            f"{_lines(run.event_lines)} in events.jsonl" if run.event_lines else "no events.jsonl"
        )
        return head + f"<p>None ({lines}).</p>"
    shown = run.problems[-20:]
    rows = "".join(
        f"<tr><td>{escape(e.timestamp)}</td><td>{escape(e.level)}</td><td>{escape(e.actor)}</td>"
        f"<td>{escape(e.message)}</td></tr>"
        for e in shown
    )
    return (
        head + f"<p>{len(run.problems)} of {_lines(run.event_lines)} in events.jsonl; the last "
        f"{len(shown)}:</p><table><tr><th>time</th><th>level</th><th>actor</th><th>event</th>"
        f"</tr>{rows}</table>"
    )


# ── helpers ──────────────────────────────────────────────────────────────────────────────────────


def _badge(report: Report) -> tuple[str, str]:
    """(css class, text): a finished run that survived faults says so, in its own calm colour."""
    state, n = report.status.state, report.faults.survived
    if n == 0 or state == "failed":
        return state, state
    text = f"{state}, {n} fault{'s' if n > 1 else ''} survived"
    return ("survived" if state == "finished" else state), text


def _faults_label(report: Report) -> str:
    return "faults" if report.status.state == "failed" else "faults survived"


def _since(time_ns: int | None, origin: int | None) -> str:
    return "-" if time_ns is None or origin is None else f"{(time_ns - origin) / 1e9:.1f}"


def _swatch(kind: str) -> str:
    """A small square in the colour the figures mark `kind` with."""
    color = REDONE_COLOR if kind == "redone" else FAULT_STYLES.get(kind, ("#7f7f7f", "--"))[0]
    return f"<span style='color:{color}'>&#9632;</span> "


def _why(cost: StepCost) -> str:
    value = cost.parts[cost.cause]
    if cost.cause_excess_s > 0:
        return f"{cost.cause}: {value:.3f} s, +{cost.cause_excess_s:.3f} s over its median"
    return f"{cost.cause}: {value:.3f} s (the largest part; no part above its usual)"


def _figure(png: bytes, alt: str, caption: str) -> str:
    return (
        f"<figure><img alt='{escape(alt)}' src='{data_uri(png)}'>"
        f"<figcaption>{escape(caption)}</figcaption></figure>"
    )


def _notes(notes: list[str]) -> str:
    if not notes:
        return ""
    items = "".join(f"<li>{escape(n)}</li>" for n in notes)
    return f"<div class='notes'><ul>{items}</ul></div>"


def _get(config: dict[str, Any], *paths: str, sep: str = ", ") -> str:
    values = []
    for path in paths:
        node: Any = config
        for key in path.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            values.append(str(node))
    return sep.join(values) or "-"


def _layout(config: dict[str, Any]) -> str:
    ranks, engines = _get(config, "train.world_size"), _get(config, "rollout.engines")
    return f"{ranks} train ranks, {engines} engines" if "-" not in (ranks, engines) else "-"


def _lines(n: int) -> str:
    return f"{n} line" if n == 1 else f"{n} lines"


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")
