"""The program's own root file system, built by `init` and entered with pivot_root.

The new root is a tmpfs mounted over the work dir's path (a directory that exists and is ours;
the sources below are all elsewhere). It holds, at their host paths: the interpreter's
directories and `SYSTEM_PATHS` (read-only binds), the work dir (a fresh tmpfs), /proc (a new proc
of this pid namespace) and /dev (a tmpfs with binds of `DEV_NODES` only). Once `init` is inside,
the host's tree is detached.
"""

from __future__ import annotations

import ctypes
import errno
import os

from .kernel import (
    MNT_DETACH,
    MS_BIND,
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    call,
    libc,
    mount,
)
from .mounts import bind, mount_table, work_tmpfs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# What the program's root holds besides the interpreter's directories and the work dir, read-only:
# the system's shared libraries (and its commands, for `subprocess`). A path that is a symlink on
# the host (/lib -> usr/lib where /usr is merged) becomes the same symlink.
SYSTEM_PATHS: tuple[str, ...] = ("/usr/bin", "/usr/lib", "/usr/lib64", "/usr/lib32", "/bin")
SYSTEM_PATHS += ("/lib", "/lib64", "/lib32", "/etc/ld.so.cache")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1"}
DEV_LINKS |= {"stderr": "/proc/self/fd/2"}
# pivot_root(2) has no libc wrapper: its system call number, per architecture.
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41, "s390x": 217}
SYS_PIVOT_ROOT |= {"ppc64le": 203, "ppc64": 203}


def private_root(cfg: dict[str, Any], notes: dict[str, Any], code: bytes) -> None:
    """Build the program's own root and pivot_root into it; the host's tree is then detached."""
    workdir: str = cfg["workdir"]
    machine = os.uname().machine
    if machine not in SYS_PIVOT_ROOT:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown system call number on {machine}")
    root = workdir
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    os.makedirs(root + workdir)
    work_tmpfs(cfg, root + workdir, code)
    notes["tmpfs_workdir"] = True
    _show_host_paths(root, [*cfg["expose"], *cfg.get("extra_paths", ()), *SYSTEM_PATHS])
    # /proc of the new pid namespace: only its own processes. Mounted by init, a member of that
    # namespace (the launcher is not). Without a pid namespace there is no /proc at all.
    if notes["pidns"]:
        os.mkdir(root + "/proc")
        try:
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY
            mount("proc", root + "/proc", "proc", flags, None)
            notes["private_proc"] = True
        except OSError as e:
            notes["private_proc_error"] = str(e)
    dev = _make_dev(root + "/dev")
    # Everything but the work dir becomes read-only (and nosuid; nodev but for the device nodes).
    for point, flags in mount_table():
        if point == root + workdir or not (point == root or point.startswith(root + "/")):
            continue
        flags |= MS_RDONLY | MS_NOSUID | (0 if point.startswith(dev + "/") else MS_NODEV)
        mount(None, point, None, MS_BIND | MS_REMOUNT | flags, None)
    notes["readonly_fs"] = True
    _pivot_into(root, machine)


def _show_host_paths(root: str, paths: list[str]) -> None:
    """Bind each host path (or copy its symlink) to the same place under `root`."""
    dirs = [p.rstrip("/") + "/" for p in paths if os.path.isdir(p) and not os.path.islink(p)]
    for path in dict.fromkeys(paths):
        if any(path.startswith(d) for d in dirs):
            continue  # inside another one (e.g. /usr/bin when the interpreter is /usr's)
        if os.path.islink(path):
            os.makedirs(os.path.dirname(root + path), exist_ok=True)
            if not os.path.lexists(root + path):
                os.symlink(os.readlink(path), root + path)
        elif os.path.exists(path):
            bind(path, root + path)


def _make_dev(dev: str) -> str:
    """A minimal /dev at `dev`: binds of `DEV_NODES`, and the `DEV_LINKS` symlinks."""
    os.mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in DEV_NODES:
        if os.path.exists(f"/dev/{name}"):
            bind(f"/dev/{name}", f"{dev}/{name}")
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    return dev


def _pivot_into(root: str, machine: str) -> None:
    """Make `root` the root, and detach the host's tree from under it."""
    # pivot_root(".", "."): the new root goes to "/", with the old one stacked on top of it, which
    # the detaching unmount then takes away (as runc does; see pivot_root(2)).
    os.chdir(root)
    call(libc.syscall, ctypes.c_long(SYS_PIVOT_ROOT[machine]), b".", b".")
    try:
        call(libc.umount2, b".", MNT_DETACH)
    except OSError as e:  # not a fallback case: the host's tree would still be there
        raise RuntimeError(f"cannot detach the host's root after pivot_root: {e}") from e
    os.chdir("/")
