"""Set-up every Miles actor process runs first (logs, traces), the addresses actors share, and
the end of an actor."""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import secrets
import signal
import socket
from pathlib import Path
from typing import Any, TypeVar, cast

import ray
import structlog
from opentelemetry import trace
from ray.actor import ActorHandle, ActorProxy

from miles.core.observability.logsetup import configure_logging
from miles.runtime.tracing import configure_tracing

T = TypeVar("T")


def dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 PID` makes this process print every thread's stack to its stderr (an actor's
    goes to its Ray worker log): where a stuck run waits, without a debugger. Nothing where
    stderr is not a file (a caller capturing it)."""
    with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def init_actor_process(run_dir: str | None, *, role: str, log_level: str = "info") -> None:
    """Configures structlog (JSON lines to stderr, and events.jsonl) and the OTel SDK
    (traces.jsonl) in this worker process."""
    dump_stacks_on_sigusr1()
    path = Path(run_dir) if run_dir else None
    configure_logging("json", log_level, events_path=path / "events.jsonl" if path else None)
    configure_tracing(path, service_name=f"miles.{role}")
    structlog.contextvars.bind_contextvars(actor=role, pid=os.getpid())


def flush_traces() -> None:
    provider: Any = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()


def kill_actor(actor: ActorProxy[T]) -> None:
    """Stops `actor` for good, without a restart. Ray types a handle as `ActorProxy` (handle or
    class, so that mypy sees the class's methods); at run time it is always the handle."""
    ray.kill(cast(ActorHandle[T], actor), no_restart=True)


def node_id() -> str:
    """The Ray node this process runs on."""
    return str(ray.get_runtime_context().get_node_id())


def node_address() -> str:
    return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]


def free_port() -> int:
    """A port free now; another process may take it before it is bound (see `reserve_port`)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def reserve_port() -> socket.socket:
    """A socket holding a free port, bound but not listening, with SO_REUSEADDR: no other
    process is given the port while it is held, yet a server that also sets SO_REUSEADDR (a
    torch TCPStore does) binds it in this process. Close it once that server listens."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("", 0))
    return s


def private_ray_token() -> Path | None:
    """Ray's auth token file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token), readable by its user
    only: made here with a fresh token if missing (Ray would write it with the umask's mode),
    its mode narrowed if it is open to others. None when the token comes from RAY_AUTH_TOKEN."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return None
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        return path
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(16))
    return path
