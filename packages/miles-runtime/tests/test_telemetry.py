"""Logs carry trace context; spans reach traces.jsonl and the standard OTLP/HTTP exporter."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

SCRIPT = """
import structlog, sys
from pathlib import Path
from typing import ClassVar
from miles.core.observability.logsetup import configure_logging
from miles.runtime.tracing import configure_tracing, shutdown_tracing
from miles.core.observability.telemetry import span, carrier, attached

run_dir = Path(sys.argv[1])
configure_logging("json", "info", events_path=run_dir / "events.jsonl")
configure_tracing(run_dir, service_name="test")
log = structlog.get_logger()
log.info("outside")
with span("miles.step", step=1, run_id="r1"):
    log.warning("inside", detail=7)
    import logging, warnings
    logging.getLogger("some.library").error("library error %d", 5)
    warnings.warn("something is deprecated", DeprecationWarning, stacklevel=1)
    logging.getLogger("some.library").info("library info: not recorded")
    remote = carrier()
with attached(remote), span("miles.train_step", step=1):
    pass
shutdown_tracing()
"""


def run_script(run_dir: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(run_dir)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
        timeout=60,
    )


def test_logs_and_spans_link(tmp_path: Path) -> None:
    proc = run_script(tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    lines = [json.loads(x) for x in proc.stderr.splitlines() if x.startswith("{")]
    outside = next(x for x in lines if x["event"] == "outside")
    inside = next(x for x in lines if x["event"] == "inside")
    assert "trace_id" not in outside
    spans = {
        s["name"]: s for s in map(json.loads, (tmp_path / "traces.jsonl").read_text().splitlines())
    }
    step, train = spans["miles.step"], spans["miles.train_step"]
    assert inside["trace_id"] == step["trace_id"] and inside["span_id"] == step["span_id"]
    # Context carried through a carrier dict (as across a Ray call) makes a child, same trace.
    assert train["trace_id"] == step["trace_id"] and train["parent_span_id"] == step["span_id"]
    assert step["attributes"] == {"step": 1, "run_id": "r1"}
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][:2] == ["outside", "inside"]
    # Warnings and errors from the standard logging module and from `warnings` are events too,
    # with the span they happened in; library INFO lines are not.
    library = next(e for e in events if e["event"] == "library error 5")
    assert library["level"] == "error" and library["logger"] == "some.library"
    warned = next(e for e in events if "something is deprecated" in e["event"])
    assert warned["level"] == "warning"
    for event in (library, warned):
        assert (event["trace_id"], event["span_id"]) == (step["trace_id"], step["span_id"])
    assert not any("not recorded" in e["event"] for e in events)


class _Collector(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, bytes, str]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.received.append((self.path, body, self.headers.get("Content-Type", "")))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_spans_go_to_standard_otlp_exporter(tmp_path: Path) -> None:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    server = HTTPServer(("127.0.0.1", 0), _Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        run_script(
            tmp_path, {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{server.server_port}"}
        )
    finally:
        server.shutdown()
    assert _Collector.received, "no OTLP request arrived"
    path, body, content_type = _Collector.received[0]
    assert path == "/v1/traces" and content_type == "application/x-protobuf"
    request = ExportTraceServiceRequest.FromString(body)
    names = {s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
    assert names == {"miles.step", "miles.train_step"}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_human_logs_on_a_terminal_json_lines_otherwise(
    tty: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import structlog

    from miles.core.observability.logsetup import configure_logging

    stream = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        configure_logging("auto", "info")
        structlog.get_logger().info("engine ready", engine=3)
    finally:
        monkeypatch.undo()
        configure_logging("json", "info")
    line = re.sub(r"\x1b\[[0-9;]*m", "", stream.getvalue().strip().splitlines()[-1])  # colours
    if tty:
        assert "engine ready" in line and "engine=3" in line and not line.startswith("{")
    else:
        assert json.loads(line)["event"] == "engine ready"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_shows_reward_step_time_and_eta(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.runtime.loop.progress import Progress

    stream = _Terminal()  # the bar is for a terminal; a pipe gets step lines (below)
    monkeypatch.setattr(sys, "stderr", stream)
    progress = Progress(4, 0, enabled=True)
    for step in range(2):
        progress.update({"rollout/reward_mean": 0.25 * (step + 1), "perf/step_s": 1.5})
    progress.close()
    monkeypatch.undo()
    last = stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]
    assert "2/4" in last and "reward=0.500" in last and "step_s=1.50" in last
    assert re.search(r"\d\d:\d\d<\d\d:\d\d", last), last  # elapsed<remaining: the ETA


def test_without_a_terminal_progress_is_a_plain_step_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a pipe no bar is drawn (it would be glued into the log lines): a `step` line instead,
    at most every 10 s and at the last step."""
    from structlog.testing import capture_logs

    from miles.runtime.loop.progress import Progress

    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    with capture_logs() as logs:
        progress = Progress(3, 0, enabled=True)
        for _ in range(3):
            progress.update({"rollout/reward_mean": 0.5, "perf/step_s": 0.1})
        progress.close()
    monkeypatch.undo()
    assert stream.getvalue() == ""
    assert [e["step"] for e in logs if e["event"] == "step"] == ["3/3"]


def test_an_otlp_endpoint_without_a_collector_is_said_once(tmp_path: Path) -> None:
    """The audit: an OTLP endpoint with no collector printed a dozen retry lines per batch."""
    from miles.runtime.cluster.process import free_port

    program = f"""
from pathlib import Path
from opentelemetry import trace
from miles.core.observability.logsetup import configure_logging
from miles.runtime.tracing import configure_tracing, shutdown_tracing
configure_logging("json", "info")
provider = configure_tracing(Path({str(tmp_path)!r}))
tracer = trace.get_tracer("probe")
for i in range(5):
    with tracer.start_as_current_span(f"span{{i}}"):
        pass
    provider.force_flush()
shutdown_tracing()
"""
    env = {
        **os.environ,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{free_port()}",  # nothing listens
        "OTEL_EXPORTER_OTLP_TIMEOUT": "2",
    }
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "OTLP collector unreachable" in lines[0], lines
    assert len((tmp_path / "traces.jsonl").read_text().splitlines()) == 5  # every span kept


def test_human_lines_are_short_but_never_cut_a_warning() -> None:
    from miles.core.observability.logsetup import HumanLines

    render = HumanLines(colours=False)
    layout = [{"role": "train", "node_id": "f" * 56}, {"role": "engine", "node_id": "e" * 56}]
    line = render(None, "", {"event": "placement", "level": "info", "layout": layout,
                             "trace_id": "a" * 32, "span_id": "b" * 16, "note": "n" * 300})  # fmt: skip
    assert "layout=<2 items; see events.jsonl>" in line and "a" * 32 not in line
    assert len(line) < 250 and line.endswith("…")
    warning = render(
        None, "", {"event": "checkpoint skipped", "level": "warning", "why": "w" * 300}
    )
    assert "w" * 300 in warning
