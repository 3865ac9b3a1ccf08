"""The weak fallback (`allow_weak` only) when `init` cannot build a private root.

The program then sees the host's tree, read-only, with a private tmpfs work dir and, given a pid
namespace, a private /proc.
"""

from __future__ import annotations

import os

from .kernel import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_RDONLY, MS_REC, MS_REMOUNT, mount
from .mounts import mount_table, work_tmpfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def host_view(cfg: dict[str, Any], notes: dict[str, Any], code: bytes) -> None:
    """The program's file system without a private root; see the module docstring."""
    workdir, uid = cfg["workdir"], cfg["uid"]
    try:
        work_tmpfs(cfg, workdir, code)
        notes["tmpfs_workdir"] = True
    except OSError as e:
        notes["tmpfs_workdir"] = False
        notes["tmpfs_workdir_error"] = str(e)
        mount(workdir, workdir, None, MS_BIND, None)  # a mount of its own, so it stays writable
    if notes["pidns"]:
        try:
            mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            notes["private_proc"] = True
        except OSError as e:
            notes["private_proc_error"] = str(e)
    if uid is not None:  # the interpreter's directories, and the work dir itself
        notes["exposed"] = expose([*cfg["expose"], workdir])
    # Every other mount becomes read-only. MS_BIND makes this a per-mount flag of our private
    # copies: the host's file systems are untouched.
    failed = []
    for point, flags in mount_table():
        if point == workdir:
            continue
        try:  # keep the mount's own flags (nodev, noexec, ...): only ever add restrictions
            mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | flags, None)
        except OSError:
            failed.append(point)
    notes["readonly_fs"] = not failed
    if failed:
        notes["readonly_fs_failed"] = failed[:20]


def expose(paths: list[str]) -> list[str]:
    """Make `paths` (the interpreter's own directories) reachable for an unprivileged uid.

    E.g. a pyenv Python under /root (mode 0700): a fresh tmpfs hides the closed directory and
    holds bind mounts of just the needed paths, so the program can import the standard library
    but sees nothing else of /root. Returns the directories it covered.
    """
    blocked: dict[str, list[str]] = {}
    for path in paths:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:i])
            if not os.stat(ancestor).st_mode & 0o001:  # not searchable by others
                blocked.setdefault(ancestor, []).append(path)
                break
    for top, inner in blocked.items():
        fds = [(path, os.open(path, os.O_PATH)) for path in inner]
        mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for path, fd in fds:
            os.makedirs(path, exist_ok=True)
            mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
            os.close(fd)
    return sorted(blocked)
