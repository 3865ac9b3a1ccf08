"""The sandbox launcher: run as `python -I _launcher.py CONFIG_FD` by `miles.rewards.sandbox`.

Standard library only (it runs in isolated mode, without miles on the path); its steps live in
`_isolate/` beside it. Its config comes on a pipe (the fd is its one argument), so nothing inside
can read it from /proc/1/cmdline. Three processes:

    launcher (host pid namespace; isolates itself, then waits)
      └─ init   (pid 1 of a fresh pid namespace: when it exits, the kernel kills everything in it)
           └─ user (limits set, privileges dropped, then runs solution.py in-process)

The launcher first joins the run's memory cgroup (made by the runner, when the machine allows
one), then unshares the network, pid, mount and IPC namespaces, and caps the new IPC namespace's
shared memory at the memory limit. `init`, the first process of
the new pid namespace, builds the program's root file system (a fresh tmpfs holding read-only
bind mounts of the interpreter and the system libraries, the work dir, a /proc of its own pid
namespace and a minimal /dev) and `pivot_root`s into it, detaching the host's tree. Each step is
recorded; if one that `REQUIRED` lists fails, `init` refuses to run the program unless the config
allows weak isolation, and then falls back step by step (see docs/sandbox.md). `init` reports
what was enforced and how `user` ended as JSON lines on the info pipe, whose copy `user` closes
before any untrusted code runs. `user` installs a seccomp filter last: no new namespaces (user
namespaces included), no keyrings (state that would outlive the run), no mounts, BPF, io_uring,
userfaultfd, perf events or kernel modules; and no memfd_create where no cgroup counts its pages.
"""

from __future__ import annotations

import contextlib  # (runpy imports it anyway)
import errno
import json
import os
import runpy
import signal
import sys

# Each launcher start pays for its imports: `typing` and `traceback` (needed on errors only) are
# not imported at run time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

if TYPE_CHECKING or __package__:  # imported as miles.rewards.sandbox._launcher (tests, mypy)
    from miles.rewards.sandbox._isolate import hostview, namespaces, rootfs, seccomp, user
    from miles.rewards.sandbox._isolate.kernel import MNT_DETACH, PR_SET_PDEATHSIG, call, libc
else:
    # Run as a script: isolated mode puts neither miles nor this directory on sys.path. The steps
    # come from `_isolate/` beside this file, which is on the path for these imports only.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        from _isolate import hostview, namespaces, rootfs, seccomp, user
        from _isolate.kernel import MNT_DETACH, PR_SET_PDEATHSIG, call, libc
    finally:
        del sys.path[0]

# Exit code of `init` when the sandbox itself could not be set up (an internal error, not the code's).
SETUP_FAILED = 111
# Without these, isolation is weak: untrusted code runs only with all of them, or with `allow_weak`.
REQUIRED = ("netns", "pidns", "mountns", "ipcns", "private_root", "private_proc", "uid", "seccomp")

# The fallback for a system without network namespaces; tests call it directly.
_block_sockets = user.block_sockets


def _files(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
    """The program's file system, in `init` (which, unlike the launcher, is in the new pid ns)."""
    workdir = cfg["workdir"]
    with open(os.path.join(workdir, "solution.py"), "rb") as f:
        code = f.read()
    os.umask(0o022)
    try:
        if "private_root" in cfg.get("unavailable", ()):
            raise OSError(errno.EPERM, "unavailable (simulated)")
        rootfs.private_root(cfg, notes, code)
        notes["private_root"] = True
        return
    except OSError as e:
        notes["private_root"] = False
        notes["private_root_error"] = str(e)
    if not cfg["allow_weak"]:
        return  # refused: see `_init`
    # Undo a partly built root (mounted over the work dir), then fall back to the host's tree.
    with contextlib.suppress(OSError):
        call(libc.umount2, workdir.encode(), MNT_DETACH)
    hostview.host_view(cfg, notes, code)


def _init(cfg: dict[str, Any], notes: dict[str, Any], info_fd: int) -> int | None:
    """pid 1 of the sandbox: start `user`, wait for it, report. Never runs untrusted code.

    Returns init's exit code; or None in the `user` child, which is then ready to run the program.
    """
    call(libc.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if notes["mountns"]:
        _files(cfg, notes)
    machine = os.uname().machine
    notes["seccomp"] = machine in seccomp.SYSCALLS and "seccomp" not in cfg.get("unavailable", ())
    if not notes["seccomp"]:
        notes["seccomp_error"] = f"no system call table for {machine}"
    for name in REQUIRED:
        notes.setdefault(name, False)
    missing = [name for name in REQUIRED if not notes[name]]
    if missing and not cfg["allow_weak"]:
        os.write(info_fd, (json.dumps({"refused": missing, "setup": notes}) + "\n").encode())
        return SETUP_FAILED
    pid = os.fork()
    if pid == 0:
        try:
            user.become_user(cfg, notes, info_fd)
        except BaseException:
            import traceback

            traceback.print_exc()
            os._exit(SETUP_FAILED)
        return None
    os.write(info_fd, (json.dumps({"setup": notes}) + "\n").encode())
    _, status, usage = os.wait4(pid, 0)
    report = {
        "exit_code": os.waitstatus_to_exitcode(status),
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "max_rss_kb": usage.ru_maxrss,
    }
    os.write(info_fd, (json.dumps({"end": report}) + "\n").encode())
    return 0


def _fatal(info_fd: int) -> None:
    import traceback

    os.write(info_fd, (json.dumps({"fatal": traceback.format_exc()}) + "\n").encode())


def main() -> int | None:
    """The launcher's exit code; None in the `user` process."""
    cfg_fd = int(sys.argv[1])
    with os.fdopen(cfg_fd, "rb") as f:
        cfg = json.loads(f.read())
    info_fd = cfg["info_fd"]
    notes: dict[str, Any] = {}
    try:
        namespaces.join_cgroup(cfg, notes)
        if os.geteuid() == 0:
            namespaces.unshare(cfg, notes)
        else:
            notes.update(netns=False, pidns=False, mountns=False, reason="not root")
        notes["uid"] = cfg["uid"] is not None
    except BaseException:
        _fatal(info_fd)
        return SETUP_FAILED
    pid = os.fork()  # the first child of a new pid namespace is its pid 1
    if pid == 0:
        try:
            code = _init(cfg, notes, info_fd)
        except BaseException:
            _fatal(info_fd)
            code = SETUP_FAILED
        if code is None:
            return None  # the user process
        os._exit(code)
    os.close(info_fd)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if status else 0


if __name__ == "__main__":
    if (exit_code := main()) is not None:
        sys.exit(exit_code)
    # The user process, at the top level so that it ends as `python solution.py` would: an
    # uncaught exception prints its traceback and exits 1, SystemExit exits with its code.
    del exit_code
    runpy.run_path("solution.py", run_name="__main__")
