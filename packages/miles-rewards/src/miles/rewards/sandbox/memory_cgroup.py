"""A memory cgroup per sandboxed run: all the memory the program takes counts against its limit.

RLIMIT_AS caps each process's address space, but SysV shared memory and memfd pages written
with `write` are never mapped, so they escape it. A memory cgroup charges every page the run's
processes bring in, whatever kind. The runner (trusted) makes one under its own cgroup before the
launcher starts, the launcher joins it first thing, and the runner reads its OOM count and removes
it once every process of the run is gone.

cgroup v2 where this process's cgroup can have children with the memory controller; cgroup v1's
memory hierarchy where that is what the machine has; None where neither is writable (then the
launcher caps shared memory through its IPC namespace's sysctls and denies memfd_create).
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int  # 1 or 2

    @property
    def procs(self) -> str:
        """The file the launcher writes its pid to, to join."""
        return str(self.path / "cgroup.procs")

    def oom_kills(self) -> int:
        """How many of the run's processes the kernel killed for going over the limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Remove the cgroup (its processes are gone; the kernel may take a moment to agree)."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


def make_memory_cgroup(limit_bytes: int) -> MemoryCgroup | None:
    """A fresh memory cgroup capped at `limit_bytes` (swap included where it can be), or None."""
    parent = _parent()
    if parent is None:
        return None
    path, version = parent
    child = path / f"miles-sandbox-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        child.mkdir()
    except OSError:
        return None
    group = MemoryCgroup(child, version)
    try:
        if version == 2:
            (child / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                (child / "memory.swap.max").write_text("0")
        else:
            (child / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # memory + swap; only after the memory limit
                (child / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
    except OSError:
        group.remove()
        return None
    return group


@functools.cache
def _parent() -> tuple[Path, int] | None:
    """This process's cgroup directory under which memory cgroups can be made, and its
    version; None if there is none. Checked once per process."""
    try:
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    for version in (2, 1):
        place = _own_directory(version, memberships, mounts)
        if place is not None and _can_have_memory_children(place, version):
            return place, version
    return None


def _own_directory(version: int, memberships: list[str], mounts: list[str]) -> Path | None:
    """Where this process's cgroup of the given version is mounted, if it is."""
    relative = None
    for line in memberships:
        number, controllers, path = line.split(":", 2)
        if (version == 2 and number == "0" and controllers == "") or (
            version == 1 and "memory" in controllers.split(",")
        ):
            relative = path
    if relative is None:
        return None
    for line in mounts:
        fields = line.split()
        dash = fields.index("-")
        fstype, options = fields[dash + 1], fields[dash + 3].split(",")
        root, point = fields[3], fields[4]
        wanted = fstype == "cgroup2" if version == 2 else fstype == "cgroup" and "memory" in options
        if wanted and (relative == root or relative.startswith(root.rstrip("/") + "/")):
            inner = relative[len(root.rstrip("/")) :].lstrip("/")
            directory = Path(point) / inner
            if directory.is_dir():
                return directory
    return None


def _can_have_memory_children(directory: Path, version: int) -> bool:
    if not os.access(directory, os.W_OK):
        return False
    if version == 1:
        return (directory / "memory.limit_in_bytes").exists()
    with contextlib.suppress(OSError):
        return "memory" in (directory / "cgroup.subtree_control").read_text().split()
    return False
