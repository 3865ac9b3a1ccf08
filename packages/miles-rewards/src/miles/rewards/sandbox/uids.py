"""Leasing a sandbox uid: a uid no one else runs as, for the length of one run.

Why per-run uids: RLIMIT_NPROC counts processes per real uid, so a shared uid would let one fork bomb
starve every concurrent run; and a uid that only this run uses lets the cleanup kill "everything of
that uid" without touching anything else. Leases are `flock`s on one file per uid, so they hold across
processes (several reward workers on one host) and vanish if the holder dies.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

DEFAULT_UID_BASE = 61000  # a range that distributions leave unallocated (below 65534 "nobody")
DEFAULT_UID_COUNT = 512


def _lock_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "miles-sandbox-uids")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.lstat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} must be a private directory owned by uid {os.geteuid()}")
    return path


@contextmanager
def lease_uid(base: int = DEFAULT_UID_BASE, count: int = DEFAULT_UID_COUNT) -> Iterator[int]:
    """Hold one free uid in [base, base + count) until the block exits."""
    lock_dir = _lock_dir()
    # Start at a pid-dependent slot so concurrent processes rarely contend for the same files.
    start = os.getpid() % count
    for i in range(count):
        uid = base + (start + i) % count
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)  # releases the lock
        return
    raise RuntimeError(f"all {count} sandbox uids from {base} are in use")
