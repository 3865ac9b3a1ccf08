"""Tracing helpers for library code. They use only the OpenTelemetry API.

Without a configured SDK these are no-ops; `miles` (the CLI) and every Miles actor configure one,
see `miles.runtime.tracing`. Trace context crosses Ray calls as a plain dict carrier, so one run
is one trace.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context, propagate, trace

tracer = trace.get_tracer("miles")


@contextmanager
def span(name: str, /, **attributes: Any) -> Iterator[trace.Span]:
    """A span named like ``miles.rollout``; step, run and actor ids go in attributes."""
    with tracer.start_as_current_span(name, attributes=_clean(attributes)) as current:
        yield current


def carrier() -> dict[str, str]:
    """The current trace context, to pass along with a remote call."""
    out: dict[str, str] = {}
    propagate.inject(out)
    return out


@contextmanager
def attached(trace_carrier: dict[str, str] | None) -> Iterator[None]:
    """Makes spans opened inside children of the caller's span (the remote side of `carrier`)."""
    if not trace_carrier:
        yield
        return
    token = context.attach(propagate.extract(trace_carrier))
    try:
        yield
    finally:
        context.detach(token)


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if isinstance(v, str | bool | int | float)}
