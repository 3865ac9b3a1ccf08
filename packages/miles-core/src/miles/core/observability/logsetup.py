"""Configures structlog: for the CLI and for each Miles actor process.

Library code only calls `structlog.get_logger()`; this module decides where lines go.

* Human-readable on a TTY, JSON lines otherwise (or as forced by ``--log-format``). A human line
  is short: time, level, message and its values, without the span ids, and with long values
  (a run's layout) cut down; the full line is in ``events.jsonl``. A line logged with
  ``_quiet=True`` (progress detail, e.g. each warm-start loss) goes to events.jsonl only.
* Lines logged inside a span carry its ``trace_id`` and ``span_id`` (in JSON and events.jsonl).
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
import time
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
        line = json.dumps({k: v for k, v in event_dict.items() if k != "_quiet"}, default=str)
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


def _drop_quiet(_: Any, __: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    if event_dict.pop("_quiet", False):
        raise structlog.DropEvent
    return event_dict


# Kept in JSON and events.jsonl; a person at a terminal has no use for them.
_MACHINE_KEYS = frozenset({"trace_id", "span_id", "timestamp", "pid"})
_LEVEL_COLOURS = {"warning": "\x1b[33m", "error": "\x1b[31m", "critical": "\x1b[31m"}
_LONGEST_VALUE = 80  # a list or dict longer than this, written out, is summarised
_LONGEST_TEXT = 160  # an info line's text value is cut here; a warning's or error's never


class HumanLines:
    """`HH:MM:SS level message key=value ...`, one line, for a person at a terminal."""

    def __init__(self, colours: bool) -> None:
        self.colours = colours

    def __call__(self, _: Any, __: str, event_dict: dict[str, Any]) -> str:
        level = str(event_dict.pop("level", "info"))
        message = str(event_dict.pop("event", ""))
        clock = time.strftime("%H:%M:%S")  # local time, when the line is written
        exception = event_dict.pop("exception", None)
        cut = level in ("debug", "info")
        pairs = " ".join(
            f"{key}={_short(value, cut)}"
            for key, value in event_dict.items()
            if key not in _MACHINE_KEYS and value is not None
        )
        tag = f"{level:<7}"
        if self.colours and level in _LEVEL_COLOURS:
            tag = f"{_LEVEL_COLOURS[level]}{tag}\x1b[0m"
        line = f"{clock} {tag} {message}" + (f"  {pairs}" if pairs else "")
        return line + (f"\n{exception}" if exception else "")


def _short(value: Any, cut: bool) -> str:
    if isinstance(value, str):
        text = json.dumps(value) if (" " in value or not value) else value
        return text[: _LONGEST_TEXT - 1] + "…" if cut and len(text) > _LONGEST_TEXT else text
    text = json.dumps(value, default=str)
    if len(text) > _LONGEST_VALUE and isinstance(value, list | tuple | dict):
        return f"<{len(value)} items; see events.jsonl>"
    return text


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
    processors.append(_drop_quiet)
    if fmt == "console":
        processors.append(HumanLines(colours=sys.stderr.isatty()))
    else:
        processors.append(structlog.processors.JSONRenderer())
    _route_stdlib_logging()
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
