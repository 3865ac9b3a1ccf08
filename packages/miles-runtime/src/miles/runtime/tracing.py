"""Configures the OpenTelemetry SDK: for the CLI and for each Miles actor process.

Library code never imports this module; it only uses `opentelemetry-api` (see `telemetry`).

Spans always go to ``traces.jsonl`` in the run directory when there is one, and to the standard
OTLP exporter when the standard ``OTEL_EXPORTER_OTLP_*`` variables are set.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

_OTLP_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


# ── spans ────────────────────────────────────────────────────────────────────────────────────────


class JsonlSpanExporter(SpanExporter):
    """Writes each finished span as one JSON line. Appends are whole lines, so several actor
    processes can share one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = path.open("a", encoding="utf-8")  # O_APPEND: whole lines, any process

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_to_dict(s)) + "\n" for s in spans)
        with self._lock:
            self._file.write(lines)
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


class QuietWhenDown(SpanExporter):
    """An exporter to a collector that may not be there. The OTLP exporter retries and logs each
    failure (a dozen lines per batch with no collector); this one says once that the collector is
    unreachable, drops batches without trying for `retry_s`, then tries again, and says when
    exporting works again. traces.jsonl keeps every span either way."""

    def __init__(self, inner: SpanExporter, endpoint: str, retry_s: float = 60.0) -> None:
        self.inner, self.endpoint, self.retry_s = inner, endpoint, retry_s
        self._down_until: float | None = None  # monotonic; None: up (or not known down)
        self._said_down = False
        # Its own retry and failure lines: what we say instead is below.
        logging.getLogger("opentelemetry.exporter.otlp").setLevel(logging.CRITICAL)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        now = time.monotonic()
        if self._down_until is not None and now < self._down_until:
            return SpanExportResult.FAILURE
        try:
            result = self.inner.export(spans)
        except Exception:  # a broken exporter must not break the run
            result = SpanExportResult.FAILURE
        if result is SpanExportResult.SUCCESS:
            if self._said_down:
                structlog.get_logger().info(
                    "OTLP collector reachable again", endpoint=self.endpoint
                )
            self._down_until, self._said_down = None, False
        else:
            if not self._said_down:
                structlog.get_logger().warning(
                    "OTLP collector unreachable: spans go to traces.jsonl only; retrying quietly "
                    f"every {self.retry_s:g} s",
                    endpoint=self.endpoint,
                )
            self._down_until, self._said_down = time.monotonic() + self.retry_s, True
        return result

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.inner.shutdown()


def _otlp_endpoint() -> str:
    return next((os.environ[v] for v in reversed(_OTLP_VARS) if os.environ.get(v)), "?")


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x") if ctx else None,
        "span_id": format(ctx.span_id, "016x") if ctx else None,
        "parent_span_id": format(parent.span_id, "016x") if parent else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "resource": {k: v for k, v in span.resource.attributes.items() if k.startswith("service")},
    }


_provider: TracerProvider | None = None


def configure_tracing(run_dir: Path | None, service_name: str = "miles") -> TracerProvider:
    """Installs the global tracer provider for this process (once; later calls add the run dir)."""
    global _provider
    if _provider is None:
        _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if any(os.environ.get(v) for v in _OTLP_VARS):
            # The standard exporter reads endpoint, headers and timeout from the OTEL_* variables.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = QuietWhenDown(OTLPSpanExporter(), _otlp_endpoint())
            _provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(_provider)
    if run_dir is not None:
        _provider.add_span_processor(
            SimpleSpanProcessor(JsonlSpanExporter(run_dir / "traces.jsonl"))
        )
    return _provider


def shutdown_tracing() -> None:
    """Flushes every span processor; call before the process exits."""
    if _provider is not None:
        _provider.force_flush()
        _provider.shutdown()
