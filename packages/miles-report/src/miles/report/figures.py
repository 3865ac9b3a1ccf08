"""The report's figures, drawn with matplotlib's Agg backend into PNG bytes.

matplotlib is imported inside the functions that draw, so loading the `miles report` command
stays fast. Figures are built on `Figure` objects, not pyplot, so no
global state or GUI backend is involved.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from miles.report.faults import ENGINE_DROPPED, ENGINE_RESTART, TRAIN_RESTART, RedoBand, StepMark
from miles.report.load import RunData
from miles.report.steps import series
from miles.report.timeline import INNER, Timeline

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

DPI = 100


@dataclass(frozen=True)
class Curve:
    key: str
    label: str
    style: Literal["line", "points"] = "line"


@dataclass(frozen=True)
class CurveGroup:
    name: str  # file name stem
    title: str
    ylabel: str
    curves: tuple[Curve, ...]


CURVES: tuple[CurveGroup, ...] = (
    CurveGroup(
        "reward",
        "Reward",
        "mean reward",
        (
            Curve("rollout/reward_mean", "rollout"),
            Curve("eval/reward_mean", "eval", "points"),
        ),
    ),
    CurveGroup(
        "response_length",
        "Response length",
        "tokens",
        (
            Curve("rollout/response_len_mean", "rollout"),
            Curve("eval/response_len_mean", "eval", "points"),
        ),
    ),
    CurveGroup("loss", "Loss", "loss", (Curve("train/loss", "train/loss"),)),
    CurveGroup(
        "kl",
        "KL",
        "KL",
        (
            Curve("train/ppo_kl", "policy vs old (train/ppo_kl)"),
            Curve("train/rollout_kl", "trainer vs engine (train/rollout_kl)"),
            Curve("train/kl_ref", "policy vs reference (train/kl_ref)"),
            Curve("train/kl_reward_penalty", "KL reward penalty (train/kl_reward_penalty)"),
        ),
    ),
    CurveGroup(
        "logprob_mismatch",
        "Train-rollout logprob mismatch",
        "mean |logprob diff|",
        (Curve("train/rollout_logprob_abs_diff", "train/rollout_logprob_abs_diff"),),
    ),
    CurveGroup(
        "throughput",
        "Throughput",
        "tokens/s",
        (
            Curve("perf/tokens_per_s", "per step wall time (perf/tokens_per_s)"),
            Curve("rollout/tokens_per_s", "generation (rollout/tokens_per_s)"),
        ),
    ),
)

KIND_COLORS: dict[str, str] = {
    "step": "#e4e4e4",
    "warm-start": "#17becf",
    "rollout": "#1f77b4",
    "generate": "#ff7f0e",
    "reward": "#2ca02c",
    "train": "#d62728",
    "logprobs": "#f7a8d0",
    "weight sync": "#9467bd",
    "checkpoint": "#8c564b",
    "eval": "#bcbd22",
}


# Fault markers: a colour and a line style per kind, apart from the curves' C0-C3 and the
# timeline's stage colours; thin, so they point at a step without hiding the curve.
LineStyle = Literal["-", "--", ":"]
FAULT_STYLES: dict[str, tuple[str, LineStyle]] = {
    ENGINE_RESTART: ("#d01c8b", "--"),
    TRAIN_RESTART: ("#b2182b", "-"),
    ENGINE_DROPPED: ("#333333", ":"),
}
REDONE_COLOR = "#f4a582"


@dataclass(frozen=True)
class FaultMarks:
    """What the curve figures mark: faults at their step, and the stretches of steps redone."""

    marks: Sequence[StepMark] = ()
    bands: Sequence[RedoBand] = ()


def curve_figure(
    run: RunData, group: CurveGroup, faults: FaultMarks = FaultMarks()
) -> bytes | None:
    """One plot of the group's metrics against step; None when the run logged none of them."""
    fig = draw_curves(run, group, faults)
    return _png(fig) if fig is not None else None


def draw_curves(
    run: RunData, group: CurveGroup, faults: FaultMarks = FaultMarks()
) -> Figure | None:
    present = [(c, *series(run, c.key)) for c in group.curves]
    present = [p for p in present if p[1]]
    if not present:
        return None
    fig = _figure(6.4, 3.3)
    ax = fig.add_subplot()
    for index, (curve, steps, values) in enumerate(present):
        color = f"C{index}"
        if curve.style == "points":
            ax.plot(
                steps, values, linestyle="none", marker="D", ms=6, color=color, label=curve.label
            )
        else:
            marker = "o" if len(steps) <= 40 else None
            ax.plot(steps, values, marker=marker, ms=3.5, lw=1.6, color=color, label=curve.label)
    _mark_steps(ax, faults)
    _style(ax, group.title, "step", group.ylabel)
    if len(present) > 1 or faults.marks or faults.bands:
        ax.legend(fontsize=8)
    return fig


def _mark_steps(ax: Axes, faults: FaultMarks) -> None:
    """A vertical line per fault at its step (one legend entry per kind), steps redone shaded."""
    labelled: set[str] = set()
    for band in faults.bands:
        label = "steps redone" if "redone" not in labelled else None
        ax.axvspan(band.first, band.last, color=REDONE_COLOR, alpha=0.25, lw=0, label=label)
        labelled.add("redone")
    for mark in faults.marks:
        color, style = FAULT_STYLES.get(mark.kind, ("#7f7f7f", "--"))
        label = mark.kind if mark.kind not in labelled else None
        ax.axvline(mark.step, color=color, linestyle=style, lw=1.2, label=label)
        labelled.add(mark.kind)
        if mark.count > 1:  # several at one step share a line: say how many
            top = ("data", "axes fraction")
            ax.annotate(f"×{mark.count}", (mark.step, 1.0), xycoords=top, color=color, fontsize=7)


def idle_figure(run: RunData) -> bytes | None:
    present = [
        (label, *series(run, key))
        for key, label in (
            ("perf/trainer_idle_frac", "trainer idle"),
            ("perf/rollout_idle_frac", "rollout idle"),
        )
    ]
    present = [p for p in present if p[1]]
    if not present:
        return None
    fig = _figure(6.4, 3.3)
    ax = fig.add_subplot()
    for index, (label, steps, values) in enumerate(present):
        marker = "o" if len(steps) <= 40 else None
        percent = [100 * v for v in values]
        ax.plot(steps, percent, marker=marker, ms=3.5, lw=1.6, color=f"C{index + 2}", label=label)
    ax.set_ylim(-2, 102)
    _style(ax, "Idle time per step", "step", "% of the step idle")
    ax.legend(fontsize=8)
    return _png(fig)


def timeline_figure(timeline: Timeline) -> bytes:
    return _png(draw_timeline(timeline))


def draw_timeline(timeline: Timeline) -> Figure:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = timeline.lanes
    fig = _figure(13.0, 1.6 + 0.55 * len(lanes))
    ax = fig.add_subplot()
    y_of = {lane: i for i, lane in enumerate(lanes)}
    groups: dict[tuple[str, str, bool], list[tuple[float, float]]] = {}
    for bar in timeline.bars:
        groups.setdefault((bar.lane, bar.kind, bar.open), []).append(
            (bar.start_s, max(bar.end_s - bar.start_s, 1e-4))
        )
    for (lane, kind, is_open), ranges in sorted(groups.items(), key=lambda g: _layer(g[0][1])):
        height = 0.86 if kind == "step" else 0.36 if kind in INNER else 0.66
        ax.broken_barh(
            ranges,
            (y_of[lane] - height / 2, height),
            facecolors=KIND_COLORS.get(kind, "#7f7f7f"),
            edgecolor="black" if is_open else "white" if kind == "step" else "none",
            hatch="//" if is_open else None,
            linewidth=0.8,
        )
    if "controller" in y_of and len(timeline.steps) <= 30:
        for step, start, end in timeline.steps:
            middle, top = (start + end) / 2, y_of["controller"] - 0.42
            ax.text(middle, top, str(step), ha="center", va="top", fontsize=7, color="#555555")
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    for mark in timeline.marks:
        color, style = FAULT_STYLES.get(mark.kind, ("#7f7f7f", "--"))
        ax.axvline(mark.time_s, color=color, linestyle=style, lw=1.4, zorder=3)
        if mark.lane in y_of:
            ax.plot(mark.time_s, y_of[mark.lane], marker="X", ms=10, color=color, zorder=4)
    times = [m.time_s for m in timeline.marks]
    start, end = min([timeline.start_s, *times]), max([timeline.end_s, *times])
    pad = max((end - start) * 0.01, 1e-3)
    ax.set_xlim(start - pad, end + pad)
    _style(ax, "Timeline (one lane per actor; numbers: steps)", "seconds from the run start", "")
    ax.grid(axis="y", visible=False)
    kinds = [k for k in KIND_COLORS if any(b.kind == k for b in timeline.bars)]
    handles: list[Artist] = [Patch(facecolor=KIND_COLORS[k], label=k) for k in kinds]
    if timeline.open_spans:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="still open"))
    for kind in dict.fromkeys(m.kind for m in timeline.marks):
        color, style = FAULT_STYLES.get(kind, ("#7f7f7f", "--"))
        handles.append(Line2D([], [], color=color, linestyle=style, lw=1.4, label=kind))
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 11), fontsize=9)
    return fig


def _layer(kind: str) -> int:
    """Steps behind everything, inner stages (reward, logprobs) on top of their parents."""
    return 0 if kind == "step" else 2 if kind in INNER else 1


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)  # Agg, whatever backend pyplot may be set to elsewhere
    return fig


def _style(ax: Axes, title: str, xlabel: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, fontsize=11, loc="left")
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if xlabel == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, facecolor="white")
    return buffer.getvalue()


def all_names() -> Sequence[str]:
    """Every figure file this module can write, for clearing stale ones."""
    return [*(g.name for g in CURVES), "timeline", "idle"]
