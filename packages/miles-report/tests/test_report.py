"""`miles report` on synthetic run directories: finished, still being written, and with whole
families of metrics missing."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from html import unescape
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from miles.report import NotARunError, build_report
from miles.report.command import report
from miles.report.faults import RedoBand, StepMark, collect_faults
from miles.report.figures import CURVES, FaultMarks, draw_curves, draw_timeline
from miles.report.load import Span, load_run, read_jsonl
from miles.report.steps import run_status, slowest, step_costs, step_of_spans
from miles.report.timeline import build_timeline

T0 = 1_800_000_000_000_000_000  # ns
SEC = 1_000_000_000
FULL_FIGURES = {
    "reward",
    "response_length",
    "loss",
    "kl",
    "logprob_mismatch",
    "throughput",
    "timeline",
    "idle",
}


class SpanWriter:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._next = 0

    def add(
        self,
        name: str,
        service: str,
        start_s: float,
        end_s: float | None,
        parent: str | None = None,
        **attributes: Any,
    ) -> str:
        self._next += 1
        span_id = f"{self._next:016x}"
        self.rows.append(
            {
                "name": name,
                "trace_id": "a" * 32,
                "span_id": span_id,
                "parent_span_id": parent,
                "start_ns": T0 + int(start_s * SEC),
                "end_ns": None if end_s is None else T0 + int(end_s * SEC),
                "status": "UNSET",
                "attributes": attributes,
                "resource": {"service.name": f"miles.{service}"},
            }
        )
        return span_id


def write_run(
    root: Path,
    *,
    steps: int = 8,
    planned: int | None = None,
    slow_train: dict[int, float] | None = None,
    checkpoints: dict[int, float] | None = None,
    perf: bool = True,
    train: bool = True,
    traces: bool = True,
    finished: bool = True,
) -> Path:
    """A run directory as `miles run` leaves it: each step 0.5 s (0.1 wait, 0.3 train, 0.05
    sync), unless `slow_train` or a checkpoint (seconds, taken after the step) says otherwise."""
    slow_train, checkpoints = slow_train or {}, checkpoints or {}
    root.mkdir(parents=True, exist_ok=True)
    config = {"name": "synthetic", "steps": planned or steps, "mode": "sync"}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "manifest.json").write_text(json.dumps({"run_id": "abc123"}))
    spans = SpanWriter()
    spans.add("miles.setup", "controller", 0.0, 5.0)
    t = 5.0
    metrics = []
    for step in range(steps):
        wait, train_s, sync = 0.1, slow_train.get(step, 0.3), 0.05
        step_s = wait + train_s + sync + 0.05
        sid = spans.add("miles.step", "controller", t, t + step_s, step=step)
        roll = spans.add("miles.rollout", "rollout_manager", t, t + wait, step=step)
        spans.add("miles.take", "rollout_manager", t, t + wait, sid, step=step)
        group = spans.add("miles.rollout_group", "rollout_manager", t, t + wait, roll, group=0)
        spans.add("miles.generate", "engine0", t, t + wait * 0.8, group, engine=0)
        for i in range(3):  # concurrent rewards: merged into one bar
            spans.add("miles.reward", "rollout_manager", t + 0.08, t + 0.09 + i * 0.003, group)
        ts = spans.add("miles.train_step", "train0", t + wait, t + wait + train_s, sid, step=step)
        spans.add("miles.logprobs", "train0", t + wait, t + wait + 0.05, ts, step=step, rank=0)
        ws = spans.add("miles.weight_sync", "controller", t + wait + train_s, t + step_s, sid)
        spans.add("miles.weight_sync.send", "train0", t + wait + train_s, t + step_s, ws, rank=0)
        spans.add("miles.weight_sync.receive", "engine0", t + wait + train_s, t + step_s, ws)
        t += step_s
        if step in checkpoints:
            ck = spans.add("miles.checkpoint", "controller", t, t + checkpoints[step], step=step)
            spans.add("miles.checkpoint.train", "train0", t, t + checkpoints[step] - 0.01, ck)
            t += checkpoints[step]
        row: dict[str, Any] = {
            "step": step,
            "rollout/reward_mean": 0.1 + 0.05 * step,
            "rollout/response_len_mean": 20.0 - step,
            "rollout/tokens_per_s": 900.0,
        }
        if train:
            row |= {
                "train/loss": 0.5 / (step + 1),
                "train/ppo_kl": 0.001 * step,
                "train/rollout_kl": 1e-6,
                "train/rollout_logprob_abs_diff": 1e-4,
                "train/grad_norm": None,  # non-finite values are written as null
            }
        if perf:
            row |= {
                "perf/rollout_wait_s": wait,
                "perf/train_s": train_s,
                "perf/sync_s": sync,
                "perf/step_s": step_s,
                "perf/tokens_per_s": 1000.0 / step_s,
                "perf/trainer_idle_frac": 1 - train_s / step_s,
                "perf/rollout_idle_frac": 0.6,
            }
        if step % 4 == 3:
            row["eval/reward_mean"] = 0.3
        metrics.append(row)
    if finished:
        metrics.append({"step": steps, "eval/reward_mean": 0.4})  # the end-of-run eval
        spans.add("miles.eval", "rollout_manager", t, t + 0.2, step=steps)
        spans.add("miles.run", "controller", 0.0, t + 0.3)  # written last: it closes last
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if traces:
        (root / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in spans.rows))
    events = [
        {"event": "run started", "level": "info", "timestamp": "2026-01-01T00:00:00Z"},
        {"event": "engine slow", "level": "warning", "timestamp": "2026-01-01T00:00:09Z"},
    ]
    (root / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return root


def slowest_rows(html: str) -> list[tuple[int, str]]:
    """(step, 'slow because' text) of each row of the slowest-steps table, in order."""
    table = html.split("<h2>Slowest steps</h2>", 1)[1].split("<h2>", 1)[0]
    rows = re.findall(r"<tr><td class='num'>(-?\d+)</td>.*?<td class='cause'>(.*?)</td>", table)
    return [(int(step), cause) for step, cause in rows]


def assert_embeds_every_png(out: Path, names: set[str]) -> str:
    html = (out / "index.html").read_text()
    assert {p.stem for p in out.glob("*.png")} == names
    for png in out.glob("*.png"):
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        assert f"data:image/png;base64,{base64.b64encode(data).decode()}" in html, png.name
    assert html.count("data:image/png;base64,") == len(names)
    assert "<script" not in html and "http://" not in html and "https://" not in html
    return html


# ── whole reports ────────────────────────────────────────────────────────────────────────────────


def test_finished_run(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", slow_train={5: 2.0}, checkpoints={3: 3.0, 7: 0.2})
    written = build_report(run_dir)
    out = run_dir / "report"
    assert written.page == out / "index.html"
    html = assert_embeds_every_png(out, FULL_FIGURES)
    assert "synthetic" in html and "badge finished" in html and "8 of 8" in html
    rows = slowest_rows(html)
    assert len(rows) == 5
    # step 3: 0.5 s + a 3 s checkpoint after it; step 5: training took 2 s instead of 0.3 s
    assert rows[0][0] == 3 and rows[0][1].startswith("checkpoint: 3.000 s")
    assert rows[1][0] == 5 and rows[1][1].startswith("train: 2.000 s, +1.700 s over its median")
    assert "engine slow" in html  # the warning from events.jsonl


def test_slowest_step_numbers(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", slow_train={5: 2.0}, checkpoints={3: 3.0}))
    costs = step_costs(run)
    assert [c.step for c in costs] == list(range(8))  # the eval-only row is not a step
    top = slowest(costs, 2)
    assert [c.step for c in top] == [3, 5]
    assert top[0].seconds == pytest.approx(3.5)
    assert top[0].parts["checkpoint"] == pytest.approx(3.0, abs=1e-6)
    assert top[0].from_spans == ("checkpoint",)  # no checkpoint metric: read from its span
    assert top[0].above_median_s == pytest.approx(3.0)
    assert top[1].parts["train"] == pytest.approx(2.0)
    assert top[1].parts["other"] == pytest.approx(0.05)


def test_partial_run_still_being_written(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", steps=5, planned=20, finished=False)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rollout/reward_mean": 0.3, "perf/st')  # cut mid-write
    with (run_dir / "traces.jsonl").open("a") as f:
        f.write(json.dumps(_open_span("miles.rollout", "rollout_manager", 7.6, step=5)) + "\n")
        f.write(json.dumps(_open_span("miles.generate", "engine0", 7.61, engine=0)) + "\n")
        f.write('{"name": "miles.reward", "trace_id": "aaa')
    (run_dir / "events.jsonl").unlink()

    run = load_run(run_dir)
    assert sorted(run.steps) == [0, 1, 2, 3, 4]
    assert sum(s.is_open for s in run.spans) == 2
    status = run_status(run)
    assert status.state == "running" and status.steps_done == 5
    assert "5 of 20" in status.detail

    out = tmp_path / "elsewhere"
    build_report(run_dir, out)
    html = assert_embeds_every_png(out, FULL_FIGURES)
    assert "badge running" in html
    assert "metrics.jsonl: the last line is incomplete" in html
    assert "traces.jsonl: the last line is incomplete" in html
    assert "2 spans still open" in html
    assert "no events.jsonl" in html
    assert not (run_dir / "report").exists()


def test_failed_and_resumed_runs(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", steps=4, planned=8)
    rows = read_jsonl(run_dir / "traces.jsonl").rows
    rows[-1]["status"] = "ERROR"  # the miles.run span
    (run_dir / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert run_status(load_run(run_dir)).state == "failed"
    # `miles run --resume` adds spans after the failed attempt's run span: running again.
    later = {**rows[1], "span_id": "resumed", "start_ns": rows[-1]["end_ns"] + SEC}
    later["end_ns"] = later["start_ns"] + SEC
    with (run_dir / "traces.jsonl").open("a") as f:
        f.write(json.dumps(later) + "\n")
    status = run_status(load_run(run_dir))
    assert status.state == "running" and "4 of 8 steps" in status.detail


def test_missing_metric_families(tmp_path: Path) -> None:
    """No train/*, no perf/*, no traces.jsonl: only rollout curves; no timeline, idle or costs."""
    run_dir = write_run(tmp_path / "run", train=False, perf=False, traces=False)
    out = run_dir / "report"
    out.mkdir()
    (out / "loss.png").write_bytes(b"from an earlier report")  # must not linger
    proc = CliRunner().invoke(report, [str(run_dir)])
    assert proc.exit_code == 0, proc.output
    html = assert_embeds_every_png(out, {"reward", "response_length", "throughput"})
    assert "not logged in this run: Loss (train/loss)" in html
    assert "No timeline: traces.jsonl is missing" in html
    assert "No step times yet" in html
    assert "are not logged" in html  # the idle figure
    assert "badge finished" in html  # decided from config steps, without traces


def test_step_costs_from_spans_when_perf_metrics_are_missing(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", perf=False, slow_train={2: 1.5})
    costs = slowest(step_costs(load_run(run_dir)), 1)
    assert costs[0].step == 2 and costs[0].cause == "train"
    assert costs[0].seconds == pytest.approx(1.7, abs=1e-6)  # the miles.step span
    assert set(costs[0].from_spans) == {"rollout wait", "train", "weight sync"}
    build_report(run_dir)
    html = (run_dir / "report" / "index.html").read_text()
    assert slowest_rows(html)[0][0] == 2
    assert "1.500*" in html


def test_long_run_timeline_is_capped(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path / "run", steps=45))
    timeline = build_timeline(run, max_steps=20)
    assert timeline is not None
    assert [s[0] for s in timeline.steps] == list(range(25, 45))
    assert any("showing the last 20 of 45 steps (from step 25)" in n for n in timeline.notes)
    assert timeline.lanes == ["controller", "rollout_manager", "engine0", "train0"]
    rewards = [b for b in timeline.bars if b.kind == "reward"]
    assert len(rewards) == 20  # three concurrent reward spans per step, one bar each step


# ── the CLI ──────────────────────────────────────────────────────────────────────────────────────


def test_cli_prints_paths(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    proc = CliRunner().invoke(report, [str(run_dir), "--out", str(tmp_path / "r")])
    assert proc.exit_code == 0, proc.output
    lines = proc.stdout.splitlines()
    assert lines[0] == str(tmp_path / "r" / "index.html")
    assert {Path(p).name for p in lines[1:]} == {f"{n}.png" for n in FULL_FIGURES}
    assert all(Path(p).is_file() for p in lines)


def test_cli_not_a_run(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    proc = CliRunner().invoke(report, [str(tmp_path)])
    assert proc.exit_code == 1
    assert "is not a Miles run directory" in proc.output and "config.yaml" in proc.output
    with pytest.raises(NotARunError):
        build_report(tmp_path)
    missing = CliRunner().invoke(report, [str(tmp_path / "nope")])
    assert missing.exit_code == 2


# ── readers ──────────────────────────────────────────────────────────────────────────────────────


def test_read_jsonl_skips_bad_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\nnot json\n[1, 2]\n\n{"b": 2}\n{"c": ')
    read = read_jsonl(path)
    assert read.rows == [{"a": 1}, {"b": 2}]
    assert read.bad_lines == [2, 3, 6] and read.cut_last
    assert read_jsonl(tmp_path / "missing.jsonl").rows == []


def test_step_of_spans_inherits_and_survives_cycles() -> None:
    def span(sid: str, parent: str | None, **attrs: Any) -> Span:
        return Span("s", sid, parent, 0, 1, "UNSET", "x", attrs)

    spans = [
        span("a", None, step=4),
        span("b", "a"),
        span("c", "b"),
        span("d", "missing"),
        span("e", "f"),
        span("f", "e"),
    ]
    assert step_of_spans(spans) == {"a": 4, "b": 4, "c": 4}


def _open_span(name: str, service: str, start_s: float, **attributes: Any) -> dict[str, Any]:
    return {
        "name": name,
        "span_id": f"open-{name}",
        "parent_span_id": None,
        "start_ns": T0 + int(start_s * SEC),
        "end_ns": None,
        "status": "UNSET",
        "attributes": attributes,
        "resource": {"service.name": f"miles.{service}"},
    }


def test_the_plugin_adds_the_command_to_miles() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "miles.core.cli", "report", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Write an HTML report of a run" in out


# ── faults ───────────────────────────────────────────────────────────────────────────────────────


def iso(seconds: float) -> str:
    """structlog's timestamp of `seconds` after T0, on the clock of the synthetic spans."""
    moment = datetime.fromtimestamp(0, UTC) + timedelta(microseconds=(T0 + seconds * SEC) // 1000)
    return moment.isoformat().replace("+00:00", "Z")


def add_faults(
    run_dir: Path, events: list[dict[str, Any]], counters: dict[str, dict[int, float]]
) -> None:
    """Appends fault lines to events.jsonl and sets cumulative counters on the metrics rows:
    `counters[key][step]` is the value from that step on."""
    with (run_dir / "events.jsonl").open("a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    rows = read_jsonl(run_dir / "metrics.jsonl").rows
    for row in rows:
        if "rollout/reward_mean" not in row:
            continue  # the end-of-run eval row carries no counters
        for key, rises in counters.items():
            row[key] = max((v for s, v in rises.items() if s <= row["step"]), default=0.0)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def rollout_span_id(run_dir: Path, step: int) -> str:
    rows = read_jsonl(run_dir / "traces.jsonl").rows
    return next(
        r["span_id"]
        for r in rows
        if r["name"] == "miles.rollout" and r["attributes"]["step"] == step
    )


def faults_rows(html: str) -> list[list[str]]:
    """The cells of each row of the Faults table (tags stripped)."""
    table = html.split("<h2 id='faults'>Faults</h2>", 1)[1].split("<h2>", 1)[0]
    rows = re.findall(r"<tr><td>(.*?)</tr>", table)
    return [
        [unescape(re.sub(r"<.*?>", "", c)).strip() for c in ("<td>" + r).split("</td>")[:-1]]
        for r in rows
    ]


def faulty_run(root: Path) -> Path:
    """8 steps of 0.55 s from 5 s: two engine restarts, a train restart, an engine dropped."""
    run_dir = write_run(root)
    warn = {"level": "warning", "actor": "rollout_manager"}
    events = [
        # engine 1 fails and comes back inside step 2 (5 + 2 * 0.55 = 6.1 .. 6.65 s): no step key
        {"event": "engine failed", "fault": "engine_failed", "engine": 1, "reason": "OOM"}
        | warn
        | {"timestamp": iso(6.2)},
        {"event": "engine back", "fault": "engine_restarted", "engine": 1, "level": "info"}
        | {"actor": "rollout_manager", "timestamp": iso(6.4)},
        # logged in step 4's rollout span, at a time outside any step: the span decides
        {"event": "engine back", "fault": "engine_restarted", "engine": 0, "level": "info"}
        | {"timestamp": iso(1.0), "span_id": rollout_span_id(run_dir, 4)},
        {"event": "train group restarted", "fault": "train_restarted", "step": 5}
        | {"restored": "checkpoint of step 3", "steps_redone": 2, "level": "warning"}
        | {"timestamp": iso(7.9)},
        # after the last step: only the counter, reaching 1 at step 7, places it
        {"event": "engine dropped", "fault": "engine_dropped", "engine": 1}
        | {"reason": "failed 3 times"}
        | warn
        | {"timestamp": iso(9.6)},
    ]
    counters = {
        "fault/engine_restarts": {2: 1.0, 4: 2.0},
        "fault/train_restarts": {5: 1.0},
        "fault/steps_redone": {5: 2.0},
        "fault/engines_dropped": {7: 1.0},
    }
    add_faults(run_dir, events, counters)
    return run_dir


def test_faults_from_events_and_counters(tmp_path: Path) -> None:
    run = load_run(faulty_run(tmp_path / "run"))
    faults = collect_faults(run)
    assert faults.counts == {"engine restart": 2, "train restart": 1, "engine dropped": 1}
    assert faults.survived == 4 and faults.steps_redone == 2
    assert (
        faults.summary() == "2 engine restarts, 1 train restart (2 steps redone), 1 engine dropped"
    )
    assert [(f.kind, f.step, f.engine) for f in faults.faults] == [
        ("engine restart", 4, 0),  # logged at 1 s: first in time
        ("engine restart", 2, 1),
        ("train restart", 5, None),
        ("engine dropped", 7, 1),
    ]
    assert "engine 1 failed (OOM); restarted" in faults.faults[1].detail
    assert "restarted from checkpoint of step 3, 2 steps redone" in faults.faults[2].detail
    assert "dropped" in faults.faults[3].detail and "failed 3 times" in faults.faults[3].detail
    assert faults.marks == [
        StepMark(2, "engine restart", 1),
        StepMark(4, "engine restart", 1),
        StepMark(5, "train restart", 1),
        StepMark(7, "engine dropped", 1),
    ]
    assert faults.bands == [RedoBand(3, 5, 2)]

    timeline = build_timeline(run, faults.faults)
    assert timeline is not None
    assert [(m.kind, round(m.time_s, 3), m.lane) for m in timeline.marks] == [
        ("engine restart", 1.0, "engine0"),
        ("engine restart", 6.4, None),  # engine 1 has no lane of its own here
        ("train restart", 7.9, None),
        ("engine dropped", 9.6, None),
    ]


def test_fault_markers_reach_the_figures(tmp_path: Path) -> None:
    run = load_run(faulty_run(tmp_path / "run"))
    faults = collect_faults(run)
    fig = draw_curves(run, CURVES[0], FaultMarks(faults.marks, faults.bands))
    assert fig is not None
    ax = fig.axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert {"engine restart", "train restart", "engine dropped", "steps redone"} <= set(labels)
    vertical = [line for line in ax.get_lines() if len(set(line.get_xdata())) == 1]
    assert sorted(line.get_xdata()[0] for line in vertical) == [2, 4, 5, 7]
    assert len(ax.patches) == 1  # the band of steps redone

    timeline = build_timeline(run, faults.faults)
    assert timeline is not None
    figure = draw_timeline(timeline)
    legend = {t.get_text() for t in figure.legends[0].get_texts()}
    assert {"engine restart", "train restart", "engine dropped"} <= legend
    assert figure.axes[0].get_xlim()[0] < 1.0  # the restart at 1 s is in view


def test_report_lists_faults(tmp_path: Path) -> None:
    run_dir = faulty_run(tmp_path / "run")
    build_report(run_dir)
    html = assert_embeds_every_png(run_dir / "report", FULL_FIGURES)
    assert "<span class='badge survived'>finished, 4 faults survived</span>" in html
    assert (
        "<th>faults survived</th><td>2 engine restarts, 1 train restart (2 steps redone), "
        "1 engine dropped</td>" in html
    )
    rows = faults_rows(html)
    assert [(r[2], r[3], r[4]) for r in rows] == [
        ("4", "■ engine restart", "controller"),
        ("2", "■ engine restart", "rollout_manager"),
        ("5", "■ train restart", "controller"),
        ("7", "■ engine dropped", "rollout_manager"),
    ]
    assert rows[1][0] == iso(6.4) and rows[1][1] == "6.4"  # seconds from the miles.run start
    assert "engine 1 failed (OOM); restarted; it serves again" in rows[1][5]


def test_faults_known_from_counters_only(tmp_path: Path) -> None:
    """A producer that writes only the counters (or a lost events.jsonl): rows at the steps where
    the counters rose; a train restart with no event still shades the steps it redid."""
    run_dir = write_run(tmp_path / "run")
    counters = {"fault/train_restarts": {3: 1.0}, "fault/steps_redone": {3: 2.0}}
    add_faults(run_dir, [], counters | {"fault/engine_restarts": {6: 2.0}})
    faults = collect_faults(load_run(run_dir))
    assert faults.summary() == "2 engine restarts, 1 train restart (2 steps redone)"
    assert [(f.kind, f.step, f.steps_redone) for f in faults.faults] == [
        ("train restart", 3, 2),
        ("engine restart", 6, 0),
        ("engine restart", 6, 0),
    ]
    assert faults.marks == [StepMark(3, "train restart", 1), StepMark(6, "engine restart", 2)]
    assert faults.bands == [RedoBand(1, 3, 2)]
    assert "fault/engine_restarts rose at step 6" in faults.faults[1].detail


def test_a_failure_without_restart_or_step(tmp_path: Path) -> None:
    """An older run (no counters) whose engine failed during setup, with nothing after it: listed,
    on the timeline's time axis only, not counted as survived."""
    run_dir = write_run(tmp_path / "run")
    failed = {"event": "engine failed", "fault": "engine_failed", "engine": 0, "reason": "gone"}
    add_faults(run_dir, [failed | {"level": "warning", "timestamp": iso(2.0)}], {})
    run = load_run(run_dir)
    faults = collect_faults(run)
    assert faults.survived == 0 and faults.summary() == "none" and faults.marks == []
    assert [(f.kind, f.step) for f in faults.faults] == [("engine failed", None)]
    assert "no restart or drop logged after it" in faults.faults[0].detail
    build_report(run_dir)
    html = (run_dir / "report" / "index.html").read_text()
    assert "badge finished'>finished</span>" in html
    assert faults_rows(html)[0][2:4] == ["-", "■ engine failed"]


def test_more_counted_than_logged_is_noted(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    restart = {"event": "back", "fault": "engine_restarted", "engine": 0, "level": "info"}
    add_faults(run_dir, [restart | {"timestamp": iso(6.2)}], {"fault/engine_restarts": {2: 3.0}})
    faults = collect_faults(load_run(run_dir))
    assert faults.counts["engine restart"] == 3 and len(faults.faults) == 1
    assert "fault/engine_restarts counts 3 but events.jsonl has 1" in faults.notes[0]


def test_no_faults_reads_none(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    build_report(run_dir)
    html = (run_dir / "report" / "index.html").read_text()
    assert "<th>faults survived</th><td>none</td>" in html
    assert "<h2 id='faults'>Faults</h2><p>None:" in html


def test_an_unknown_fault_kind_is_listed_not_counted(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run")
    line = {"event": "rollout manager respawned", "fault": "manager_restarted", "step": 3}
    add_faults(run_dir, [line | {"level": "warning", "timestamp": iso(7.0)}], {})
    faults = collect_faults(load_run(run_dir))
    assert faults.survived == 0 and faults.marks == []
    assert [(f.kind, f.step, f.detail) for f in faults.faults] == [
        ("manager restarted", 3, "rollout manager respawned")
    ]
