"""What `init` builds the program's file system with: the mount table, binds, the work dir."""

from __future__ import annotations

import os

from .kernel import MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_REC, mount

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024}
_MOUNT_FLAGS |= {"nodiratime": 2048, "relatime": 1 << 21}


def mount_table() -> list[tuple[str, int]]:
    """(mount point, its per-mount flags) for every mount of this namespace."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4]
            # mountinfo escapes space, tab, newline and backslash as octal.
            for esc, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                point = point.replace(esc, ch)
            flags = sum(_MOUNT_FLAGS.get(opt, 0) for opt in fields[5].split(","))
            mounts.append((point, flags))
    return mounts


def bind(source: str, target: str) -> None:
    """Bind-mount `source` (a directory or a file) at `target`, making the mount point."""
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()  # a mount point for a file
    mount(source, target, None, MS_BIND | MS_REC, None)


def work_tmpfs(cfg: dict[str, Any], path: str, code: bytes) -> None:
    """A size-capped tmpfs at `path`, holding solution.py and owned by the program's uid."""
    uid, gid = cfg["uid"], cfg["gid"]
    owner = f",uid={uid},gid={gid}" if uid is not None else ""
    opts = f"size={cfg['disk_bytes']},nr_inodes={cfg['max_files']},mode=0700{owner}"
    mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    with open(os.path.join(path, "solution.py"), "wb") as f:
        f.write(code)
    if uid is not None:
        os.chown(os.path.join(path, "solution.py"), uid, gid)
