"""`miles report`: read a run directory, draw the figures, write the page and the PNGs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import miles.report.figures as figures
from miles.report.faults import collect_faults
from miles.report.html import Report, render
from miles.report.load import load_run
from miles.report.steps import run_status, slowest, step_costs
from miles.report.timeline import build_timeline

PAGE = "index.html"


@dataclass(frozen=True)
class Written:
    page: Path
    figures: list[Path]


def build_report(run_dir: Path, out_dir: Path | None = None) -> Written:
    """Writes OUT/index.html (self-contained) and OUT/*.png; OUT defaults to RUN_DIR/report.

    Raises NotARunError for a directory that is not a run."""
    run = load_run(run_dir)
    out = out_dir if out_dir is not None else run_dir / "report"
    faults = collect_faults(run)
    marks = figures.FaultMarks(faults.marks, faults.bands)
    curves = [(g, figures.curve_figure(run, g, marks)) for g in figures.CURVES]
    timeline = build_timeline(run, faults.faults)
    costs = step_costs(run)
    report = Report(
        run=run,
        status=run_status(run),
        curves=[(g, png) for g, png in curves if png is not None],
        missing=[g for g, png in curves if png is None],
        timeline=timeline,
        timeline_png=figures.timeline_figure(timeline) if timeline is not None else None,
        idle_png=figures.idle_figure(run),
        costs=costs,
        slowest=slowest(costs),
        faults=faults,
    )
    pngs = {group.name: png for group, png in report.curves}
    if report.timeline_png is not None:
        pngs["timeline"] = report.timeline_png
    if report.idle_png is not None:
        pngs["idle"] = report.idle_png

    out.mkdir(parents=True, exist_ok=True)
    for name in figures.all_names():  # a figure not drawn this time must not linger from before
        if name not in pngs:
            (out / f"{name}.png").unlink(missing_ok=True)
    written = [_write(out / f"{name}.png", png) for name, png in pngs.items()]
    page = _write(out / PAGE, render(report).encode("utf-8"))
    return Written(page, written)


def _write(path: Path, data: bytes) -> Path:
    """Write-then-rename, so a browser reloading the report never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return path
