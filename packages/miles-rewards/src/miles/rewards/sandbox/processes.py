"""Finding and killing every process of a run, and removing its work dir afterwards.

A run's processes are those of its process group (the launcher starts a session of its own) and,
when it has a uid of its own, every process of that uid.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from miles.rewards.sandbox.errors import SandboxError


def proc_ids(pid: str) -> tuple[int, int] | None:
    """(process group, real uid) of a live process, or None if it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may contain spaces and ")"
    if fields[0] == "Z":
        return None
    uid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("Uid:"))
    return int(fields[2]), uid


def survivors(pgid: int, uid: int | None) -> list[int]:
    """Live processes of the run: in its process group, or (when it has its own uid) of that uid."""
    found = []
    for entry in os.listdir("/proc"):
        ids = proc_ids(entry) if entry.isdigit() else None
        if ids is not None and (ids[0] == pgid or (uid is not None and ids[1] == uid)):
            found.append(int(entry))
    return found


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def sweep(pgid: int, uid: int | None, deadline_s: float = 2.0) -> int:
    """Kill whatever of the run is still alive; returns how many processes it had to kill."""
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while alive := survivors(pgid, uid):
        if time.monotonic() > end:
            raise SandboxError(f"sandbox processes {alive} survive SIGKILL")
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        await asyncio.sleep(0.01)
    return len(killed)


def rmtree(path: str) -> None:
    """`shutil.rmtree`, also through directories and files the program made unwritable."""

    def make_writable(func: Any, p: str, _exc: Any) -> None:  # it may have chmod-ed files 0400
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(p)

    shutil.rmtree(path, onerror=make_writable)
