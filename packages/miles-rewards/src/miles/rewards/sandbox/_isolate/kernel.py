"""The libc calls the launcher makes through ctypes, and the kernel's flags they take."""

from __future__ import annotations

import ctypes
import os

# Each launcher start pays for its imports: `typing` is not imported at run time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

libc = ctypes.CDLL(None, use_errno=True)


def call(fn: Any, *args: Any) -> None:
    """Call a libc function that returns 0 on success; raise its errno as OSError otherwise."""
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    call(libc.mount, enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])
