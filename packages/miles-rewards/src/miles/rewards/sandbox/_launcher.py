"""The sandbox launcher: run as `python -I _launcher.py CONFIG_JSON` by `miles.rewards.sandbox`.

Standard library only (it runs in isolated mode, without miles on the path). Three processes:

    launcher (host pid namespace; isolates itself, then waits)
      └─ init   (pid 1 of a fresh pid namespace: when it exits, the kernel kills everything in it)
           └─ user (limits set, privileges dropped, then runs solution.py in-process)

Each isolation step is attempted separately and recorded; one that the system refuses falls back
(see docs/sandbox.md). `init` reports what was enforced and how `user` ended as JSON lines on the
info pipe, whose copy `user` closes before any untrusted code runs.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import runpy
import signal
import sys
import traceback
from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# Exit code of `init` when the sandbox itself could not be set up (an internal error, not the code's).
SETUP_FAILED = 111

_libc = ctypes.CDLL(None, use_errno=True)


def _call(fn: Any, *args: Any) -> None:
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _call(_libc.mount, enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3])


_MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": 1024}
_MOUNT_FLAGS |= {"nodiratime": 2048, "relatime": 1 << 21}


def _mounts() -> list[tuple[str, int]]:
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


def _expose(paths: list[str]) -> list[str]:
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
        _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        for path, fd in fds:
            os.makedirs(path, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC, None)
            os.close(fd)
    return sorted(blocked)


def _isolate(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
    """Namespaces and mounts, in the launcher (root only; each step may fail independently)."""
    for name, flag in (("netns", CLONE_NEWNET), ("pidns", CLONE_NEWPID), ("mountns", CLONE_NEWNS)):
        try:
            _call(_libc.unshare, flag)
            notes[name] = True
        except OSError as e:
            notes[name] = False
            notes[f"{name}_error"] = str(e)
    if not notes["mountns"]:
        return
    workdir, uid, gid = cfg["workdir"], cfg["uid"], cfg["gid"]
    # Nothing we mount from here on may leak back to the host's mount namespace.
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    # The work dir becomes a size-capped tmpfs that exists only inside this namespace.
    with open(os.path.join(workdir, "solution.py"), "rb") as f:
        code = f.read()
    owner = f",uid={uid},gid={gid}" if uid is not None else ""
    opts = f"size={cfg['disk_bytes']},nr_inodes={cfg['max_files']},mode=0700{owner}"
    try:
        _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, opts)
        notes["tmpfs_workdir"] = True
        with open(os.path.join(workdir, "solution.py"), "wb") as f:
            f.write(code)
        if uid is not None:
            os.chown(os.path.join(workdir, "solution.py"), uid, gid)
    except OSError as e:
        notes["tmpfs_workdir"] = False
        notes["tmpfs_workdir_error"] = str(e)
        _mount(workdir, workdir, None, MS_BIND, None)  # a mount of its own, so it stays writable
    if uid is not None:  # the interpreter's directories, and the work dir itself
        notes["exposed"] = _expose([*cfg["expose"], workdir])
    # Every other mount becomes read-only. MS_BIND makes this a per-mount flag of our private
    # copies: the host's file systems are untouched.
    failed = []
    for point, flags in _mounts():
        if point == workdir:
            continue
        try:  # keep the mount's own flags (nodev, noexec, ...): only ever add restrictions
            _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | flags, None)
        except OSError:
            failed.append(point)
    notes["readonly_fs"] = not failed
    if failed:
        notes["readonly_fs_failed"] = failed[:20]


def _set_limits(cfg: dict[str, Any]) -> None:
    def cap(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CPU, cfg["cpu_s"])
    cap(resource.RLIMIT_AS, cfg["memory_bytes"])
    cap(resource.RLIMIT_FSIZE, cfg["file_size_bytes"])
    cap(resource.RLIMIT_NOFILE, cfg["max_open_files"])
    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NPROC, cfg["nproc"])


def _block_sockets() -> None:
    """Fallback when there is no network namespace: refuse to create non-Unix sockets.

    Weak by nature (ctypes, a subprocess running curl, or restoring `_socket` itself get around it),
    so docs/sandbox.md says to rely on it only for honest code.
    """
    import _socket

    class _Guarded(_socket.socket):
        __slots__ = ()  # `socket.socket` adds its own __weakref__ slot

        def __init__(self, family: int = -1, *args: Any, **kwargs: Any) -> None:
            if family != _socket.AF_UNIX:
                raise PermissionError("network access is disabled in the sandbox")
            super().__init__(family, *args, **kwargs)

    # `socket.socket` subclasses `_socket.socket` when `socket` is first imported, which the
    # launcher has not done yet; patching the base here therefore covers both.
    assert "socket" not in sys.modules
    _socket.socket = _Guarded  # type: ignore[misc]


def _become_user(cfg: dict[str, Any], notes: dict[str, Any], info_fd: int) -> None:
    """In the `user` process: limits, environment, dropped privileges; then the info fd closes."""
    workdir = cfg["workdir"]
    os.chdir(workdir)
    _set_limits(cfg)
    env = {
        "HOME": workdir,
        "TMPDIR": workdir,
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        # One thread per library: threads count against the process cap, and the CPU is shared.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    os.environ.clear()
    os.environ.update(env)
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
    # No set-uid binary (su, sudo, ...) can hand privileges back.
    _call(_libc.prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    # Changing credentials cleared the parent-death signal; set it now, after the change.
    _call(_libc.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if not notes["netns"]:
        _block_sockets()
    # Fail here, as a sandbox error, if the dropped uid cannot reach the program or the standard
    # library (e.g. a closed parent directory and no mount namespace to open a way).
    open("solution.py", "rb").close()
    import pkgutil  # noqa: F401  (runpy imports it lazily; any unreadable stdlib shows up here)

    sys.argv = ["solution.py"]
    sys.path.insert(0, workdir)  # as for `python solution.py`: its own directory comes first
    # The last trusted act: say the sandbox is in place, and give up the channel that says so.
    os.write(info_fd, b'{"ready": true}\n')
    os.close(info_fd)


def _init(cfg: dict[str, Any], notes: dict[str, Any], info_fd: int) -> int | None:
    """pid 1 of the sandbox: start `user`, wait for it, report. Never runs untrusted code.

    Returns init's exit code; or None in the `user` child, which is then ready to run the program.
    """
    _call(_libc.prctl, PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    pid = os.fork()
    if pid == 0:
        try:
            _become_user(cfg, notes, info_fd)
        except BaseException:
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


def main() -> int | None:
    """The launcher's exit code; None in the `user` process."""
    cfg = json.loads(sys.argv[1])
    info_fd = cfg["info_fd"]
    notes: dict[str, Any] = {}
    try:
        if os.geteuid() == 0:
            _isolate(cfg, notes)
        else:
            notes.update(netns=False, pidns=False, mountns=False, reason="not root")
        notes["uid"] = cfg["uid"] is not None
    except BaseException:
        os.write(info_fd, (json.dumps({"fatal": traceback.format_exc()}) + "\n").encode())
        return SETUP_FAILED
    pid = os.fork()  # the first child of a new pid namespace is its pid 1
    if pid == 0:
        try:
            code = _init(cfg, notes, info_fd)
        except BaseException:
            os.write(info_fd, (json.dumps({"fatal": traceback.format_exc()}) + "\n").encode())
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
