"""The `user` process's last trusted steps: limits, environment, dropped privileges, seccomp.

It then closes its copy of the info pipe, so nothing the program does can forge `init`'s report.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

from . import seccomp
from .kernel import PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, call, libc

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def set_limits(cfg: dict[str, Any]) -> None:
    def cap(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CPU, cfg["cpu_s"])
    cap(resource.RLIMIT_AS, cfg["memory_bytes"])
    cap(resource.RLIMIT_FSIZE, cfg["file_size_bytes"])
    cap(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NPROC, cfg["nproc"])
    cap(resource.RLIMIT_MSGQUEUE, 0)  # POSIX message queues: kernel memory, outside RLIMIT_AS


def block_sockets() -> None:
    """Fallback when there is no network namespace: refuse to create non-Unix sockets.

    Weak by nature (ctypes, a subprocess running curl, or restoring `_socket` itself get around it),
    so docs/sandbox.md says to rely on it only for honest code.
    """
    import _socket

    class _Guarded(_socket.socket):
        __slots__ = ()  # `socket.socket` adds its own __weakref__ slot

        def __init__(self, family: int = -1, *args: Any, **kwargs: Any) -> None:
            if family != _socket.AF_UNIX:
                raise PermissionError("network access is disabled in the sandbox")
            super().__init__(family, *args, **kwargs)

    # `socket.socket` subclasses `_socket.socket` when `socket` is first imported, which the
    # launcher has not done yet; patching the base here therefore covers both.
    assert "socket" not in sys.modules
    _socket.socket = _Guarded  # type: ignore[misc]


def become_user(cfg: dict[str, Any], notes: dict[str, Any], info_fd: int) -> None:
    """In the `user` process: limits, environment, dropped privileges; then the info fd closes."""
    workdir = cfg["workdir"]
    os.chdir(workdir)
    set_limits(cfg)
    env = {
        "HOME": workdir,
        "TMPDIR": workdir,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        # One thread per library: threads count against the process cap, and the CPU is shared.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    os.environ.clear()
    os.environ.update(env)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    # No set-uid binary (su, sudo, ...) can hand privileges back.
    call(libc.prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    # Changing credentials cleared the parent-death signal; set it now, after the change.
    call(libc.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if notes["seccomp"]:
        seccomp.install(deny_memfd=not notes.get("memory_cgroup"))
    if not notes["netns"]:
        block_sockets()
    # Fail here, as a sandbox error, if the dropped uid cannot reach the program or the standard
    # library (e.g. a closed parent directory and no mount namespace to open a way).
    open("solution.py", "rb").close()
    import pkgutil  # noqa: F401  (runpy imports it lazily; any unreadable stdlib shows up here)

    sys.argv = ["solution.py"]
    sys.path.insert(0, workdir)  # as for `python solution.py`: its own directory comes first
    # The last trusted act: say the sandbox is in place, and give up the channel that says so.
    os.write(info_fd, b'{"ready": true}\n')
    os.close(info_fd)
