"""One observed run, checked every way. The run (`traced_run` in conftest.py: two steps, two
train ranks, two engines, every metric sink) is made once per test worker, so all its checks
live in this one file:

- tracing: one run is one trace; its span tree as written to traces.jsonl, and the same spans
  received over OTLP/HTTP on loopback by a receiver that decodes the protobuf payload (the
  standard exporter, set up only by OTEL_* variables);
- metric sinks: TensorBoard, W&B (offline) and MLflow next to metrics.jsonl, a sink that breaks
  mid-run, and a missing sink package caught before launch;
- the report: `miles report` on the run, rendered by headless Chromium, must show its figures.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from miles.runtime.runner import RunRequest, run_from_cli

from .conftest import TRACED_ENGINES as ENGINES
from .conftest import TRACED_RANKS as RANKS
from .conftest import TRACED_STEPS as STEPS
from .conftest import read_jsonl, run_miles, write_config

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

# ── tracing ───────────────────────────────────────────────────────────────────────────────────


def _tree(spans: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    by_id = {s["span_id"]: s for s in spans}
    children: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in spans:
        if s["parent_span_id"]:
            children[s["parent_span_id"]].append(s)
    return by_id, children


def _service(span: dict[str, Any]) -> str:
    return str(span["resource"]["service.name"])


def _under(children: dict[str, list[dict[str, Any]]], span: dict[str, Any], name: str) -> list:
    return [c for c in children[span["span_id"]] if c["name"] == name]


def test_the_span_tree_of_a_two_step_run(traced_run: tuple[Path, list[Any]]) -> None:
    spans = read_jsonl(traced_run[0] / "traces.jsonl")
    by_id, children = _tree(spans)
    assert len({s["trace_id"] for s in spans}) == 1  # one run, one trace
    orphans = [s["name"] for s in spans if s["parent_span_id"] and s["parent_span_id"] not in by_id]
    assert not orphans, f"spans whose parent is missing: {orphans}"
    (root,) = [s for s in spans if not s["parent_span_id"]]
    assert (root["name"], _service(root)) == ("miles.run", "miles.controller")

    steps = _under(children, root, "miles.step")
    assert sorted(s["attributes"]["step"] for s in steps) == [1, 2]
    for step in steps:
        n = step["attributes"]["step"]
        assert {_service(s) for s in _under(children, step, "miles.take")} == {
            "miles.rollout_manager"
        }
        # Every train rank trains under the controller's step, and recomputes logprobs inside.
        trains = _under(children, step, "miles.train_step")
        assert sorted(_service(t) for t in trains) == list(RANKS), n
        for t in trains:
            assert t["attributes"]["step"] == n
            assert _under(children, t, "miles.logprobs")
        # The weight sync: every rank sends, every engine receives, under the step's sync span.
        (sync,) = _under(children, step, "miles.weight_sync")
        assert sorted(
            _service(s) for s in _under(children, sync, "miles.weight_sync.send")
        ) == list(RANKS)
        received = _under(children, sync, "miles.weight_sync.receive")
        assert sorted(_service(s) for s in received) == list(ENGINES)

    # Rollouts are produced in the background of the run (the buffer decides when a batch
    # starts): one per step, in the rollout manager, with every engine generating under them.
    rollouts = _under(children, root, "miles.rollout")
    assert sorted(r["attributes"]["step"] for r in rollouts) == [1, 2]
    engines_seen = set()
    for rollout in rollouts:
        assert _service(rollout) == "miles.rollout_manager"
        groups = _under(children, rollout, "miles.rollout_group")
        assert len(groups) == 4  # rollout.prompts_per_step
        assert len(_under(children, rollout, "miles.reward")) == 4
        for group in groups:
            engines_seen |= {_service(g) for g in _under(children, group, "miles.generate")}
    assert engines_seen == set(ENGINES)

    checkpoints = _under(children, root, "miles.checkpoint")
    assert len(checkpoints) == STEPS
    for ckpt in checkpoints:
        ranks = _under(children, ckpt, "miles.checkpoint.train")
        assert sorted(_service(r) for r in ranks) == list(RANKS)

    # Children start inside their parents (one clock: every actor runs on this machine).
    for s in spans:
        if s["parent_span_id"]:
            assert s["start_ns"] >= by_id[s["parent_span_id"]]["start_ns"], s["name"]


def test_the_same_spans_arrive_over_otlp_http(traced_run: tuple[Path, list[Any]]) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    run_dir, bodies = traced_run
    assert bodies, "no OTLP request reached the receiver"
    received: dict[str, tuple[str, str, str]] = {}
    for path, content_type, body in bodies:
        assert path == "/v1/traces" and content_type == "application/x-protobuf"
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}[
                "service.name"
            ]
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    received[s.span_id.hex()] = (s.trace_id.hex(), s.name, service)
    written = {s["span_id"]: (s["trace_id"], s["name"], _service(s)) for s in read_jsonl(
        run_dir / "traces.jsonl"
    )}  # fmt: skip
    # Every process's exporter flushed before the run ended: the collector saw every span.
    assert received == written
    assert {service for _, _, service in received.values()} >= {
        "miles.controller", "miles.rollout_manager", *RANKS, *ENGINES,
    }  # fmt: skip


# ── metric sinks ──────────────────────────────────────────────────────────────────────────────

KEY = "rollout/reward_mean"


@pytest.fixture(scope="module")
def sinks_run(traced_run: tuple[Path, Any]) -> Path:
    """tests/conftest.py's observed run: 2 steps with every sink, the last MLflow one broken."""
    return traced_run[0]


def jsonl_values(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r[KEY]) for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_every_step_reaches_metrics_jsonl(sinks_run: Path) -> None:
    assert [step for step, _ in jsonl_values(sinks_run)] == [1, 2]


def test_tensorboard_got_both_steps(sinks_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(sinks_run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    got = [(e.step, e.value) for e in events.Scalars(KEY)]
    want = jsonl_values(sinks_run)
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)  # float32


def test_wandb_got_both_steps(sinks_run: Path) -> None:
    (log_file,) = (sinks_run / "wandb").glob("offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "run" and run["tags"] == ["e2e"]
    assert run["config"]["update"]["steps"] == 2  # the run's config.yaml
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert [(h["_step"], h[KEY]) for h in history] == jsonl_values(sinks_run)


@pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SADeprecationWarning")  # inside mlflow
def test_mlflow_got_both_steps(sinks_run: Path) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{sinks_run / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("miles")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    got = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, KEY)]
    assert got == jsonl_values(sinks_run)


def test_broken_sink_is_switched_off_and_the_run_goes_on(sinks_run: Path) -> None:
    events = read_jsonl(sinks_run / "events.jsonl")
    failed = [e for e in events if e.get("event") == "metric sink failed; switching it off"]
    assert len(failed) == 1  # at the first step, once: then it is off
    assert failed[0]["sink"] == "telemetry.sinks[4] (mlflow)"  # the broken one, by position
    assert "cannot open an MLflow run" in failed[0]["error"] and "blocker" in failed[0]["error"]


def test_missing_sink_package_fails_the_config_check_before_launch(
    tmp_path: Path,
    tiny_assets: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> Any:
        return None if name == "wandb" else real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)  # wandb is "not installed"
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # run_from_cli sets it; keep it to this test
    sinks = ["jsonl", {"name": "wandb", "mode": "offline"}]
    cfg = write_config(tmp_path / "cfg.yaml", tiny_assets, telemetry={"sinks": sinks})
    run_dir = tmp_path / "run"

    code = run_from_cli(RunRequest(target=str(cfg), overrides=[], run_dir=run_dir))

    err = capsys.readouterr().err
    assert code == 2, err
    assert "telemetry.sinks[1]" in err and "pip install 'miles-sinks[wandb]'" in err
    assert not run_dir.exists()  # refused before the run dir, the controller or Ray


# ── the report ────────────────────────────────────────────────────────────────────────────────

WINDOW = (1400, 4000)
BAND_PX = 200  # the screenshot is checked in horizontal bands of this height


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "headless Chromium renders the report in this test: apt-get install chromium"
    return found


def screenshot(page: Path, png: Path, profile: Path) -> np.ndarray:
    """The page as Chromium draws it, RGB floats in [0, 1], WINDOW[1] rows by WINDOW[0]."""
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--screenshot={png}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        page.resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.is_file(), f"chromium wrote no screenshot (exit {proc.returncode}): {proc.stderr}"
    import matplotlib.image

    pixels = np.asarray(matplotlib.image.imread(png))[..., :3]
    if pixels.dtype == np.uint8:
        pixels = pixels / 255.0
    return pixels


def looks_rendered(pixels: np.ndarray) -> tuple[bool, str]:
    """Not blank, and coloured (non-grey) pixels in many bands of the page: the plots drew.

    The page itself is black, grey and white apart from a small status badge, so saturated colour
    comes from the figures' lines, markers and timeline bars."""
    non_white = float((pixels.min(axis=-1) < 0.9).mean())
    saturation = pixels.max(axis=-1) - pixels.min(axis=-1)
    coloured = saturation > 0.3
    bands = [int(coloured[y : y + BAND_PX].sum()) for y in range(0, len(coloured), BAND_PX)]
    coloured_bands = sum(n >= 300 for n in bands)
    why = f"non-white {non_white:.3f}, coloured pixels per band {bands}"
    return non_white > 0.025 and coloured_bands >= 5, why


def test_report_of_a_real_run_renders(tmp_path: Path, traced_run: tuple[Path, Any]) -> None:
    """The run of tests/conftest.py's `traced_run`: 2 steps, 2 train ranks, 2 engines, a
    checkpoint every step."""
    chromium()  # fail first, with the install hint
    run_dir = traced_run[0]
    proc = run_miles("report", str(run_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = run_dir / "report"
    written = [Path(line) for line in proc.stdout.split()]
    assert written[0] == out / "index.html"
    assert {p.name for p in written[1:]} >= {"reward.png", "loss.png", "timeline.png", "idle.png"}
    html = written[0].read_text()
    assert "badge finished" in html and "2 of 2" in html
    assert html.count("data:image/png;base64,") == len(written) - 1
    steps = re.findall(r"<tr><td class='num'>(\d+)</td>", html.split("Slowest steps", 1)[1])
    assert sorted(int(s) for s in steps) == [1, 2]  # both steps, in the top 5

    ok, why = looks_rendered(screenshot(written[0], tmp_path / "page.png", tmp_path / "chrome"))
    print(why)
    assert ok, why

    # The check can fail: the same page without its image data renders no plots.
    broken = out / "broken.html"
    broken.write_text(re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "data:,", html))
    ok, why = looks_rendered(screenshot(broken, tmp_path / "broken.png", tmp_path / "chrome"))
    print(why)
    assert not ok, f"a page without figures passed the check: {why}"


# ── profiles ──────────────────────────────────────────────────────────────────────────────────


def test_profile_steps_write_a_profile(traced_run: tuple[Path, list[Any]]) -> None:
    """`telemetry.profile_steps` ([the last step] in this run): each train rank writes the top
    operators of that step's train call and a Chrome trace; no other step is profiled."""
    import gzip

    run_dir, _ = traced_run
    profiles = run_dir / "profiles"
    names = sorted(p.name for p in profiles.iterdir())
    want = [f"train{r}-step{STEPS}{ext}" for r in range(len(RANKS)) for ext in (".json.gz", ".txt")]
    assert names == sorted(want)
    table = (profiles / f"train0-step{STEPS}.txt").read_text()
    assert "aten::mm" in table or "aten::addmm" in table  # the model's matmuls were recorded
    trace = json.loads(gzip.decompress((profiles / f"train0-step{STEPS}.json.gz").read_bytes()))
    assert trace["traceEvents"]
