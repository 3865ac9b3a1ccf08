"""`python -m miles.sglang.supervise -- COMMAND...`: runs a launched server's command and stops
it (its whole process group: SGLang starts scheduler and detokenizer processes) when the process
that launched it is gone. An engine actor killed by Ray gets no chance to clean up, and a server
left behind would hold its GPU and port: the supervisor notices its parent change within half a
second, and if the supervisor itself is killed (Ray kills a dead worker's children), the kernel
sends the server SIGTERM (Linux's parent-death signal). It exits with the server's exit code."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's process, before exec: SIGTERM when the supervisor dies (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m miles.sglang.supervise -- COMMAND...", file=sys.stderr)
        return 2
    command = argv[argv.index("--") + 1 :]
    parent = os.getppid()
    server = subprocess.Popen(command, start_new_session=True, preexec_fn=_die_with_parent)

    def stop(*_: object) -> None:
        try:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sys.exit(server.returncode if server.returncode is not None else 1)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while server.poll() is None:
        if os.getppid() != parent:  # the launcher died: we were handed to init
            stop()
        time.sleep(0.5)
    return server.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
