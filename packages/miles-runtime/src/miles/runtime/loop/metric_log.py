"""The run's metric sinks (`telemetry.sinks`): each step's metrics go to every one of them.

A sink that fails to start is left out, and one that fails to log is switched off, each named in
the log; the run goes on with the others (metrics.jsonl is one of them).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import structlog

from miles.core.config import TelemetryConfig
from miles.core.contracts.components import Kind
from miles.core.contracts.protocols import MetricSink
from miles.core.registry.factory import build_component

log = structlog.get_logger(__name__)


class MetricLog:
    def __init__(self, telemetry: TelemetryConfig, run_dir: Path) -> None:
        self.sinks: list[tuple[str, MetricSink]] = []  # (where the config names it, the sink)
        for i, ref in enumerate(telemetry.sinks):
            label = f"telemetry.sinks[{i}] ({ref.name})"
            try:
                self.sinks.append((label, build_component(Kind.METRIC_SINK, ref, str(run_dir))))
            except Exception as exc:  # e.g. a tracking server that is down: run without it
                log.error(
                    "metric sink failed to start; running without it",
                    sink=label,
                    error=f"{type(exc).__name__}: {exc}",
                )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for entry in list(self.sinks):
            name, sink = entry
            try:
                sink.log(step, metrics)
            except Exception as exc:  # a broken sink is switched off; the run goes on
                log.error(
                    "metric sink failed; switching it off",
                    sink=name,
                    error=f"{type(exc).__name__}: {exc}",
                )
                self.sinks.remove(entry)
                with contextlib.suppress(Exception):
                    sink.close()

    def close(self) -> None:
        for name, sink in self.sinks:
            try:
                sink.close()
            except Exception as exc:  # metrics already logged stay logged
                log.error("metric sink failed to close", sink=name, error=repr(exc))
