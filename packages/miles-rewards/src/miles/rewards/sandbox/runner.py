"""Running untrusted Python: `Sandbox.run` / `run_python`.

The parent side. It prepares a fresh work dir, starts `_launcher.py` in a session of its own, and
hands it to `supervise` (stdin, capped output, the wall clock, then every process of the run
killed and checked for); `outcome` turns what came back into a `SandboxResult`. The isolation
itself happens in the launcher; docs/sandbox.md describes both.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from miles.rewards.sandbox.datatypes import SandboxLimits, SandboxResult
from miles.rewards.sandbox.errors import SandboxError, SandboxUnavailable
from miles.rewards.sandbox.memory_cgroup import MemoryCgroup, make_memory_cgroup
from miles.rewards.sandbox.outcome import CPU_LIMIT_SHARE, Outcome, classify, make_result
from miles.rewards.sandbox.pipes import read_info
from miles.rewards.sandbox.processes import rmtree, survivors
from miles.rewards.sandbox.supervise import supervise
from miles.rewards.sandbox.uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, lease_uid

__all__ = ["CPU_LIMIT_SHARE", "Sandbox", "SandboxError", "SandboxUnavailable", "run_python"]

_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
# The names tests know these by, from before they moved to `outcome`.
_classify, _Outcome = classify, Outcome


class Sandbox:
    """Runs untrusted Python programs, at most `max_concurrency` at a time.

    Create it inside the event loop that uses it (its semaphore belongs to that loop). Where strong
    isolation (namespaces, a private root, a uid of its own) cannot be set up, `run` raises
    `SandboxUnavailable` unless `allow_weak`. `extra_paths`: more host paths to show the program,
    read-only, at the same place (e.g. a library directory the interpreter needs).
    """

    # Isolation steps to treat as refused by the system: a test's stand-in for such a system.
    _unavailable: tuple[str, ...] = ()

    def __init__(
        self,
        max_concurrency: int | None = None,
        *,
        python: str = sys.executable,
        uid_base: int = DEFAULT_UID_BASE,
        uid_count: int = DEFAULT_UID_COUNT,
        workdir_root: str | None = None,
        allow_weak: bool = False,
        extra_paths: tuple[str, ...] = (),
    ) -> None:
        self.allow_weak = allow_weak
        self.extra_paths = tuple(os.path.realpath(p) for p in extra_paths)
        self.max_concurrency = max_concurrency or os.cpu_count() or 1
        self.python = python
        self.workdir_root = workdir_root  # where work dirs are made; None: the system temp dir
        self.uid_base, self.uid_count = uid_base, uid_count
        self._slots = asyncio.Semaphore(self.max_concurrency)

    async def run(
        self, code: str, *, stdin: str = "", limits: SandboxLimits | None = None
    ) -> SandboxResult:
        limits = limits or SandboxLimits()
        async with self._slots:
            if os.geteuid() != 0:
                return await self._run(code, stdin, limits, uid=None)
            with lease_uid(self.uid_base, self.uid_count) as uid:
                return await self._run(code, stdin, limits, uid=uid)

    async def _run(
        self, code: str, stdin: str, limits: SandboxLimits, uid: int | None
    ) -> SandboxResult:
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="miles_sandbox_", dir=self.workdir_root))
        info_r, info_w = os.pipe()
        cgroup = None
        if uid is not None and "memory_cgroup" not in self._unavailable:
            cgroup = make_memory_cgroup(limits.memory_mb << 20)
        try:
            Path(workdir, "solution.py").write_text(code)
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chown(Path(workdir, "solution.py"), uid, uid)
            return await self._spawn(workdir, stdin, limits, uid, info_r, info_w, cgroup)
        finally:
            os.close(info_r)  # (_spawn closes info_w: a double close could hit a reused fd)
            rmtree(workdir)
            if cgroup is not None:  # every process of the run is gone (_spawn swept them)
                cgroup.remove()

    def _launcher_config(
        self,
        workdir: str,
        limits: SandboxLimits,
        uid: int | None,
        info_fd: int,
        cgroup: MemoryCgroup | None,
    ) -> dict[str, Any]:
        nproc = limits.max_processes
        if uid is None:
            # Without a uid of its own, RLIMIT_NPROC counts every process of the user running us.
            nproc += len(survivors(pgid=-1, uid=os.getuid()))
        mib = 1 << 20
        return {
            "workdir": workdir,
            "uid": uid,
            "gid": uid,
            "info_fd": info_fd,
            "cpu_s": limits.cpu_seconds,
            "memory_bytes": limits.memory_mb * mib,
            "file_size_bytes": limits.file_size_mb * mib,
            "disk_bytes": limits.disk_mb * mib,
            "max_files": limits.max_files,
            "max_open_files": limits.max_open_files,
            "nproc": nproc,
            "expose": self._interpreter_dirs(),
            "extra_paths": self.extra_paths,
            "allow_weak": self.allow_weak,
            "unavailable": self._unavailable,
            "cgroup_procs": cgroup.procs if cgroup is not None else None,
        }

    def _interpreter_dirs(self) -> list[str]:
        """The directories the program's interpreter imports from (see `_isolate.hostview`)."""
        if os.path.realpath(self.python) == os.path.realpath(sys.executable):
            dirs = {sys.base_prefix, sys.prefix, sys.exec_prefix, sys.base_exec_prefix}
        else:  # <prefix>/bin/python
            dirs = {os.path.dirname(os.path.dirname(os.path.realpath(self.python)))}
        dirs = {os.path.realpath(d) for d in dirs}
        # A directory inside another one is covered by it.
        return sorted(d for d in dirs if not any(d.startswith(o + "/") for o in dirs))

    async def _spawn(
        self,
        workdir: str,
        stdin: str,
        limits: SandboxLimits,
        uid: int | None,
        info_r: int,
        info_w: int,
        cgroup: MemoryCgroup | None,
    ) -> SandboxResult:
        start = time.monotonic()
        proc = self._start_launcher(workdir, limits, uid, info_w, cgroup)
        finished = await supervise(proc, stdin, limits, uid, start)
        return make_result(read_info(info_r), finished, limits, uid, cgroup)

    def _start_launcher(
        self,
        workdir: str,
        limits: SandboxLimits,
        uid: int | None,
        info_w: int,
        cgroup: MemoryCgroup | None,
    ) -> subprocess.Popen[bytes]:
        """Start the launcher in a session of its own; closes `info_w` (the launcher has a copy)."""
        cfg_r, cfg_w = os.pipe()
        try:
            # The config goes on a pipe, not argv: /proc/1/cmdline inside shows nothing of it.
            cfg = json.dumps(self._launcher_config(workdir, limits, uid, info_w, cgroup)).encode()
            # It must fit the pipe's buffer: it is written before the launcher reads.
            if len(cfg) >= 65536:
                raise SandboxError(f"the sandbox's config is too large ({len(cfg)} bytes)")
            os.write(cfg_w, cfg)
            os.close(cfg_w)
            cfg_w = -1
            return subprocess.Popen(
                [self.python, "-I", _LAUNCHER, str(cfg_r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: one killpg reaches the whole tree
                pass_fds=(info_w, cfg_r),
                cwd=workdir,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        finally:
            os.close(info_w)  # the launcher holds its copies
            os.close(cfg_r)
            if cfg_w >= 0:
                os.close(cfg_w)


_default: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Sandbox] = (
    weakref.WeakKeyDictionary()
)


async def run_python(
    code: str,
    *,
    stdin: str = "",
    limits: SandboxLimits | None = None,
    sandbox: Sandbox | None = None,
) -> SandboxResult:
    """Run `code` as a Python program in the sandbox: `python solution.py < stdin`.

    Uses `sandbox` if given, else one shared per event loop (concurrency: the number of CPUs).
    """
    if sandbox is None:
        loop = asyncio.get_running_loop()
        sandbox = _default.get(loop) or _default.setdefault(loop, Sandbox())
    return await sandbox.run(code, stdin=stdin, limits=limits)
