"""The launcher's own steps, before it forks `init`: the memory cgroup, then the namespaces.

Each step may fail independently; `notes` records what took effect and, for a failure, why.
"""

from __future__ import annotations

import errno
import os

from .kernel import MS_PRIVATE, MS_REC, call, libc, mount

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000


def join_cgroup(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
    """Enter the run's memory cgroup, before anything is forked: every process of the run is
    then in it."""
    procs = cfg.get("cgroup_procs")
    if not procs:
        notes["memory_cgroup"] = False
        return
    try:
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
        notes["memory_cgroup"] = True
    except OSError as e:
        notes["memory_cgroup"] = False
        notes["memory_cgroup_error"] = str(e)


def unshare(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
    """The namespaces, in the launcher (root only; each may fail independently)."""
    namespaces = (("netns", CLONE_NEWNET), ("pidns", CLONE_NEWPID), ("mountns", CLONE_NEWNS))
    for name, flag in (*namespaces, ("ipcns", CLONE_NEWIPC)):
        try:
            if name in cfg.get("unavailable", ()):  # a test's stand-in for a system that refuses
                raise OSError(errno.EPERM, "unavailable (simulated)")
            call(libc.unshare, flag)
            notes[name] = True
        except OSError as e:
            notes[name] = False
            notes[f"{name}_error"] = str(e)
    if notes["ipcns"]:
        cap_ipc(cfg, notes)
    if notes["mountns"]:
        # Nothing we mount from here on may leak back to the host's mount namespace.
        mount(None, "/", None, MS_REC | MS_PRIVATE, None)


def cap_ipc(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
    """SysV IPC of the new IPC namespace (these sysctls are its own): all shared memory together
    at most the memory limit, segments gone with their last user, few message queues."""
    pages = -(-cfg["memory_bytes"] // os.sysconf("SC_PAGE_SIZE"))
    values = {
        "shmmax": cfg["memory_bytes"], "shmall": pages, "shmmni": 64, "shm_rmid_forced": 1,
        "msgmni": 16,
    }  # fmt: skip
    try:
        for name, value in values.items():
            with open(f"/proc/sys/kernel/{name}", "w") as f:
                f.write(str(value))
        notes["ipc_capped"] = True
    except OSError as e:
        notes["ipc_capped"] = False
        notes["ipc_capped_error"] = str(e)
