"""Configures structlog: for the CLI and for each Miles actor process.

Library code only calls `structlog.get_logger()`; this module decides where lines go.

* Human-readable on a TTY, JSON lines otherwise (or as forced by ``--log-format``).
* Lines logged inside a span carry its ``trace_id`` and ``span_id``.
* With a run directory, every line is also appended as JSON to ``events.jsonl``.
* Warnings and errors logged through the standard `logging` module (transformers, Ray, torch...)
  and Python `warnings` go the same way, so they too carry the span they happened in.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from pathlib import Path
from typing import IO, Any, Literal

import structlog
from opentelemetry import trace

LogFormat = Literal["auto", "console", "json"]


def _add_trace_context(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    ctx = trace.get_current_span().get_span_context()
    if ctx.is_valid:
        event_dict["trace_id"] = format(ctx.trace_id, "032x")
        event_dict["span_id"] = format(ctx.span_id, "016x")
    return event_dict


class _EventsFile:
    """A structlog processor that appends each event as a JSON line to events.jsonl."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def __call__(self, _: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps(event_dict, default=str)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()
        return event_dict


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _without_ansi(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Terminal colour codes (Ray colours its tracebacks) out of every text value."""
    for key, value in event_dict.items():
        if isinstance(value, str) and "\x1b" in value:
            event_dict[key] = _ANSI.sub("", value)
    return event_dict


def _without_traceback(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    event_dict.pop("exception", None)
    return event_dict


class _ToStructlog(logging.Handler):
    """Forwards standard-library log records (WARNING and up) to structlog."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            log = structlog.get_logger(record.name)
            method = log.error if record.levelno >= logging.ERROR else log.warning
            method(record.getMessage(), logger=record.name)
        except Exception:  # logging must never break the caller
            self.handleError(record)


def _route_stdlib_logging() -> None:
    root = logging.getLogger()
    if not any(isinstance(h, _ToStructlog) for h in root.handlers):
        root.addHandler(_ToStructlog(logging.WARNING))
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger -> structlog


def configure_logging(
    fmt: LogFormat = "auto", level: str = "info", events_path: Path | None = None
) -> None:
    """Sets up structlog for this process. Safe to call again (e.g. once a run dir exists)."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}: use debug, info, warning or error")
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_trace_context,
        structlog.processors.format_exc_info,
        _without_ansi,
    ]
    if events_path is not None:
        processors.append(_EventsFile(events_path))
        # The traceback is in events.jsonl; the console keeps the one-line message.
        processors.append(_without_traceback)
    if fmt == "console":
        processors.append(structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()))
    else:
        processors.append(structlog.processors.JSONRenderer())
    _route_stdlib_logging()
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
