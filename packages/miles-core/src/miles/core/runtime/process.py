"""Set-up every Miles actor process runs first: logs, traces and torch threads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog


def init_actor_process(
    run_dir: str | None, *, role: str, log_level: str = "info", num_threads: int | None = None
) -> None:
    """Configures structlog (JSON lines to stderr, and events.jsonl) and the OTel SDK
    (traces.jsonl) in this worker process, and caps torch threads to the actor's CPUs."""
    from miles.core.logsetup import configure_logging
    from miles.core.observability import configure_tracing

    path = Path(run_dir) if run_dir else None
    configure_logging("json", log_level, events_path=path / "events.jsonl" if path else None)
    configure_tracing(path, service_name=f"miles.{role}")
    structlog.contextvars.bind_contextvars(actor=role, pid=os.getpid())
    if num_threads:
        import torch

        torch.set_num_threads(num_threads)


def flush_traces() -> None:
    from opentelemetry import trace

    provider: Any = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()


def node_address() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])
