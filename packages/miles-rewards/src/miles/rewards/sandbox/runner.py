"""Running untrusted Python: `Sandbox.run` / `run_python`.

The parent side. It prepares a fresh work dir, starts `_launcher.py` in a session of its own, feeds
stdin, reads stdout/stderr incrementally up to their caps, enforces the wall-clock limit, and
afterwards kills and checks for every process of the run. The isolation itself happens in the
launcher; docs/sandbox.md describes both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from miles.rewards.sandbox.datatypes import SandboxLimits, SandboxResult, Status
from miles.rewards.sandbox.memory_cgroup import MemoryCgroup, make_memory_cgroup
from miles.rewards.sandbox.uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, lease_uid

_LAUNCHER = str(Path(__file__).with_name("_launcher.py"))
_CHUNK = 1 << 16
# A SIGKILL after at least this share of the CPU-time limit is the limit's (see `_classify`).
CPU_LIMIT_SHARE = 0.8


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program in it): an internal error."""


class SandboxUnavailable(SandboxError):
    """Strong isolation is not available here, and `allow_weak` is off: nothing was run."""


# The isolation steps that strong isolation needs (`_launcher.REQUIRED`), in words.
_STEPS = {
    "netns": "a network namespace",
    "pidns": "a pid namespace",
    "mountns": "a mount namespace",
    "ipcns": "an IPC namespace",
    "private_root": "a private root file system (pivot_root)",
    "private_proc": "a /proc of its own",
    "uid": "a uid of its own (root is needed to switch to it)",
    "seccomp": "a seccomp filter (no namespaces, keyrings or mounts of its own)",
}


def _refusal(missing: list[str], setup: dict[str, Any]) -> str:
    why = []
    for name in missing:
        error = (
            setup.get(f"{name}_error")
            or setup.get("reason")
            or "not attempted, as a step it needs failed"
        )
        why.append(f"{_STEPS.get(name, name)} ({error})")
    return (
        "the sandbox refuses to run untrusted code with weak isolation: it could not set up "
        + "; ".join(why)
        + ". Run as root where namespaces are allowed, or set `sandbox.allow_weak: true` in the "
        "code reward's config (`Sandbox(allow_weak=True)`) to run it anyway, with the weaker "
        "isolation that docs/sandbox.md describes."
    )


def _proc_ids(pid: str) -> tuple[int, int] | None:
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


def _survivors(pgid: int, uid: int | None) -> list[int]:
    """Live processes of the run: in its process group, or (when it has its own uid) of that uid."""
    found = []
    for entry in os.listdir("/proc"):
        ids = _proc_ids(entry) if entry.isdigit() else None
        if ids is not None and (ids[0] == pgid or (uid is not None and ids[1] == uid)):
            found.append(int(entry))
    return found


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _sweep(pgid: int, uid: int | None, deadline_s: float = 2.0) -> int:
    """Kill whatever of the run is still alive; returns how many processes it had to kill."""
    killed: set[int] = set()
    end = time.monotonic() + deadline_s
    while survivors := _survivors(pgid, uid):
        if time.monotonic() > end:
            raise SandboxError(f"sandbox processes {survivors} survive SIGKILL")
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        await asyncio.sleep(0.01)
    return len(killed)


def _rmtree(path: str) -> None:
    def make_writable(func: Any, p: str, _exc: Any) -> None:  # it may have chmod-ed files 0400
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700)
        with contextlib.suppress(FileNotFoundError):
            func(p)

    shutil.rmtree(path, onerror=make_writable)


# Raw non-blocking fds and loop readers rather than asyncio subprocesses: in Python 3.11,
# `Process.wait()` also waits for every pipe to close, which a capped (no longer read) stdout never
# does, and the readers here must be able to stop reading at the cap.


async def _read_capped(fd: int, cap: int, over: asyncio.Event, buf: bytearray) -> None:
    """Read `fd` to EOF into `buf`, up to `cap` + 1 bytes; set `over` (and stop) past the cap."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        buf.extend(chunk[: cap + 1 - len(buf)])
        if len(buf) > cap:
            over.set()
        if (not chunk or len(buf) > cap) and not done.done():
            done.set_result(None)

    os.set_blocking(fd, False)
    loop.add_reader(fd, on_readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)


async def _feed(pipe: IO[bytes], data: bytes) -> None:
    """Write `data` to `pipe` as the program reads it, then close it (EOF)."""
    fd = pipe.fileno()
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    done = loop.create_future()

    def on_writable() -> None:
        nonlocal view
        try:
            view = view[os.write(fd, view[:_CHUNK]) :]
        except BlockingIOError:
            return
        except OSError:  # the program exited or closed its stdin
            view = view[:0]
        if not view and not done.done():
            done.set_result(None)

    os.set_blocking(fd, False)
    try:
        if data:
            loop.add_writer(fd, on_writable)
            try:
                await done
            finally:
                loop.remove_writer(fd)
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


async def _wait_exit(proc: subprocess.Popen[bytes]) -> int:
    """The exit code of `proc`, awaited through a pidfd (polled where pidfds are unavailable)."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        while proc.poll() is None:
            await asyncio.sleep(0.01)
        return proc.returncode
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return proc.wait()


def _read_info(fd: int) -> dict[str, Any]:
    """The launcher's JSON lines: {"setup": {...}}, {"end": {...}} or {"fatal": "traceback"}."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, _CHUNK):
            data += chunk
    info: dict[str, Any] = {}
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            info.update(json.loads(line))
    return info


def _isolation(
    setup: dict[str, Any], uid: int | None, cgroup: MemoryCgroup | None
) -> tuple[str, ...]:
    steps = ("netns", "pidns", "mountns", "ipcns", "private_root", "private_proc", "tmpfs_workdir")
    names = [k for k in (*steps, "readonly_fs", "ipc_capped", "seccomp") if setup.get(k)]
    if not setup.get("netns"):
        names.append("socket_guard")
    if uid is not None:
        names.append("uid")
    if cgroup is not None and setup.get("memory_cgroup"):
        names.append(f"memory_cgroup_v{cgroup.version}")
    return (*names, "rlimits", "session")


@dataclass
class _Outcome:
    timed_out: bool = False
    output_over: bool = False


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
            _rmtree(workdir)
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
            nproc += len(_survivors(pgid=-1, uid=os.getuid()))
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
        """The directories the program's interpreter imports from (see `_launcher._expose`)."""
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
        cfg_r, cfg_w = os.pipe()
        try:
            # The config goes on a pipe, not argv: /proc/1/cmdline inside shows nothing of it.
            cfg = json.dumps(self._launcher_config(workdir, limits, uid, info_w, cgroup)).encode()
            if (
                len(cfg) >= 65536
            ):  # it must fit the pipe's buffer, written before the launcher reads
                raise SandboxError(f"the sandbox's config is too large ({len(cfg)} bytes)")
            os.write(cfg_w, cfg)
            os.close(cfg_w)
            cfg_w = -1
            proc = subprocess.Popen(
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
        assert proc.stdin and proc.stdout and proc.stderr
        pgid = proc.pid
        outcome = _Outcome()
        over = asyncio.Event()
        cap = limits.max_output_bytes
        out_buf, err_buf = bytearray(), bytearray()
        feeder = asyncio.create_task(_feed(proc.stdin, stdin.encode()))
        out = asyncio.create_task(_read_capped(proc.stdout.fileno(), cap, over, out_buf))
        err = asyncio.create_task(_read_capped(proc.stderr.fileno(), cap, over, err_buf))
        waiter = asyncio.create_task(_wait_exit(proc))
        over_wait = asyncio.create_task(over.wait())
        try:
            done, _ = await asyncio.wait(
                {waiter, over_wait}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED
            )
            if waiter not in done:
                outcome.output_over = over.is_set()
                outcome.timed_out = not outcome.output_over
                _kill_group(pgid)
            await waiter
            swept = await _sweep(pgid, uid)
            wall_s = time.monotonic() - start
            # Every process is gone, so every write end is closed: the readers finish promptly.
            # If not, something outside the sandbox's reach holds them; `contained` will say so.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(out, err), timeout=2.0)
            pipes_closed = out.done() and err.done()
            outcome.output_over |= over.is_set()
            stdout, stderr = bytes(out_buf[:cap]), bytes(err_buf[:cap])
        finally:
            for task in (feeder, out, err, waiter, over_wait):
                task.cancel()
            await asyncio.gather(feeder, out, err, waiter, over_wait, return_exceptions=True)
            if proc.returncode is None:
                _kill_group(pgid)
                proc.wait()  # SIGKILL-ed: returns at once; no zombie is left behind
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                with contextlib.suppress(OSError):
                    pipe.close()
        info = _read_info(info_r)
        oom_killed = cgroup is not None and cgroup.oom_kills() > 0
        if oom_killed and "end" not in info and "fatal" not in info and "refused" not in info:
            # The kernel chose a process of the sandbox itself (launcher or init) to kill for the
            # run's memory: it picks by resident size, and the program's memfd or shared-memory
            # pages count for no process. Still the program's doing; init's report died with it.
            info["end"] = {"exit_code": -signal.SIGKILL, "cpu_s": 0.0}
            info.setdefault("ready", True)
        if "refused" in info:
            raise SandboxUnavailable(_refusal(info["refused"], info.get("setup", {})))
        if "fatal" in info or (
            "end" not in info and not (outcome.timed_out or outcome.output_over)
        ):
            raise SandboxError(
                f"the sandbox failed to start the program (launcher exit {proc.returncode}): "
                f"{info.get('fatal') or stderr.decode(errors='replace')[-2000:]}"
            )
        end = info.get("end", {})
        exit_code = end.get("exit_code")
        status, reason = _classify(exit_code, end.get("cpu_s", 0.0), stderr, outcome, limits)
        if oom_killed and status not in ("timeout", "output_limit"):
            status = "memory"
            reason = (
                f"memory limit of {limits.memory_mb} MiB reached (the run's memory cgroup, which "
                "counts shared memory and memfd pages too); killed"
            )
        if "end" in info and "ready" not in info:
            # The user process failed before the program started (e.g. setuid refused).
            raise SandboxError(f"sandbox setup failed: {stderr.decode(errors='replace')[-2000:]}")
        if swept:
            reason = f"{reason}; cleanup killed {swept} leftover process(es)".lstrip("; ")
        return SandboxResult(
            status=status,
            exit_code=exit_code,
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            wall_s=wall_s,
            contained=pipes_closed and not _survivors(pgid, uid),
            reason=reason,
            isolation=_isolation(info.get("setup", {}), uid, cgroup),
        )


def _classify(
    exit_code: int | None, cpu_s: float, stderr: bytes, outcome: _Outcome, limits: SandboxLimits
) -> tuple[Status, str]:
    if outcome.output_over:
        return "output_limit", f"output exceeded {limits.max_output_bytes} bytes; killed"
    if outcome.timed_out:
        return "timeout", f"wall-clock limit of {limits.wall_s:g}s reached; killed"
    if exit_code is None:
        return "killed", "the program ended without a report"
    # RLIMIT_CPU's SIGKILL (soft = hard). The kernel counts the CPU time by timer ticks, and on
    # a loaded machine that count runs up to ~10% ahead of the exact time wait4 reports (a 1 s
    # limit was hit at 0.93 s): so a SIGKILL near the limit is the limit's.
    if (
        exit_code in (-signal.SIGKILL, -signal.SIGXCPU)
        and cpu_s >= CPU_LIMIT_SHARE * limits.cpu_seconds
    ):
        return "timeout", f"CPU-time limit of {limits.cpu_seconds}s reached"
    if exit_code != 0 and b"MemoryError" in stderr[-4096:]:
        return "memory", f"memory limit of {limits.memory_mb} MiB reached (MemoryError)"
    if exit_code == 0:
        return "ok", ""
    if exit_code < 0:
        name = signal.Signals(-exit_code).name if -exit_code in signal.valid_signals() else "?"
        return "killed", f"killed by signal {-exit_code} ({name})"
    last = stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
    return "error", f"exit code {exit_code}: {last[0][:200]}"


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
