"""The sandbox launcher: run as `python -I _launcher.py CONFIG_JSON` by `miles.rewards.sandbox`.

Standard library only (it runs in isolated mode, without miles on the path). Its config comes
on a pipe (the fd is its one argument), so nothing inside can read it from /proc/1/cmdline.
Three processes:

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
import ctypes
import errno
import json
import os
import resource
import runpy
import signal
import sys

# Each launcher start pays for its imports: `typing` and `traceback` (needed on errors only) are
# not imported at run time.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
# Exit code of `init` when the sandbox itself could not be set up (an internal error, not the code's).
SETUP_FAILED = 111
# Without these, isolation is weak: untrusted code runs only with all of them, or with `allow_weak`.
REQUIRED = ("netns", "pidns", "mountns", "ipcns", "private_root", "private_proc", "uid", "seccomp")
# What the program's root holds besides the interpreter's directories and the work dir, read-only:
# the system's shared libraries (and its commands, for `subprocess`). A path that is a symlink on
# the host (/lib -> usr/lib where /usr is merged) becomes the same symlink.
SYSTEM_PATHS: tuple[str, ...] = ("/usr/bin", "/usr/lib", "/usr/lib64", "/usr/lib32", "/bin")
SYSTEM_PATHS += ("/lib", "/lib64", "/lib32", "/etc/ld.so.cache")
DEV_NODES = ("null", "zero", "full", "random", "urandom")
DEV_LINKS = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1"}
DEV_LINKS |= {"stderr": "/proc/self/fd/2"}
# pivot_root(2) has no libc wrapper: its system call number, per architecture.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41, "s390x": 217}
_SYS_PIVOT_ROOT |= {"ppc64le": 203, "ppc64": 203}

_libc = ctypes.CDLL(None, use_errno=True)

# -- seccomp -----------------------------------------------------------------------------------
# System calls the program has no use for, refused with EPERM. Per architecture: (the audit
# architecture seccomp reports, {name: number}).
_DENIED = [
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "userfaultfd",
    "perf_event_open",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "kexec_load",
    "init_module",
    "finit_module",
    "delete_module",
    "memfd_secret",
]
_SYSCALLS = {
    "x86_64": (0xC000003E, dict(zip(
        [*_DENIED, "memfd_create", "clone", "clone3"],
        [272, 308, 250, 248, 249, 321, 323, 298, 425, 426, 427, 165, 166, 155, 428, 429, 430,
         431, 432, 433, 442, 246, 175, 313, 176, 447, 319, 56, 435], strict=True,
    ))),
    "aarch64": (0xC00000B7, dict(zip(
        [*_DENIED, "memfd_create", "clone", "clone3"],
        [97, 268, 219, 217, 218, 280, 282, 241, 425, 426, 427, 40, 39, 41, 428, 429, 430, 431,
         432, 433, 442, 104, 105, 273, 106, 447, 279, 220, 435], strict=True,
    ))),
}  # fmt: skip
# clone's flags that make a namespace: refused, like unshare.
_CLONE_NEW_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
_CLONE_NEW_NAMESPACES |= 0x20000000 | 0x40000000 | 0x00000080
_RET_ALLOW, _RET_KILL, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
        ("k", ctypes.c_uint),
    ]  # fmt: skip


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _seccomp_program(machine: str, deny_memfd: bool) -> list[tuple[int, int, int, int]]:
    """The classic-BPF filter, as (code, jt, jf, k) instructions."""
    arch, numbers = _SYSCALLS[machine]
    denied = [numbers[name] for name in _DENIED]
    if deny_memfd:
        denied.append(numbers["memfd_create"])
    program = [
        (_LD_W_ABS, 0, 0, 4),  # seccomp_data.arch
        (_JEQ, 1, 0, arch),
        (_RET, 0, 0, _RET_KILL),  # another ABI (32-bit calls on a 64-bit kernel): never ours
        (_LD_W_ABS, 0, 0, 0),  # seccomp_data.nr
    ]
    if machine == "x86_64":  # the x32 ABI's numbers
        program += [(_JGE, 0, 1, 0x40000000), (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    for number in denied:
        program += [(_JEQ, 0, 1, number), (_RET, 0, 0, _RET_ERRNO | errno.EPERM)]
    # clone3 passes its flags in memory, out of a filter's sight: ENOSYS makes libc use clone.
    program += [(_JEQ, 0, 1, numbers["clone3"]), (_RET, 0, 0, _RET_ERRNO | errno.ENOSYS)]
    program += [
        (_JEQ, 0, 3, numbers["clone"]),
        (_LD_W_ABS, 0, 0, 16),  # the low half of args[0], clone's flags
        (_JSET, 0, 1, _CLONE_NEW_NAMESPACES),
        (_RET, 0, 0, _RET_ERRNO | errno.EPERM),
        (_RET, 0, 0, _RET_ALLOW),
    ]
    return program


def _install_seccomp(deny_memfd: bool) -> None:
    """Install the filter on this process (and so on everything it starts). Needs no_new_privs."""
    program = _seccomp_program(os.uname().machine, deny_memfd)
    filters = (_SockFilter * len(program))(*[_SockFilter(*op) for op in program])
    fprog = _SockFprog(len(program), filters)
    _call(_libc.prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)


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


def _unshare(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
    """The namespaces, in the launcher (root only; each may fail independently)."""
    namespaces = (("netns", CLONE_NEWNET), ("pidns", CLONE_NEWPID), ("mountns", CLONE_NEWNS))
    for name, flag in (*namespaces, ("ipcns", CLONE_NEWIPC)):
        try:
            if name in cfg.get("unavailable", ()):  # a test's stand-in for a system that refuses
                raise OSError(errno.EPERM, "unavailable (simulated)")
            _call(_libc.unshare, flag)
            notes[name] = True
        except OSError as e:
            notes[name] = False
            notes[f"{name}_error"] = str(e)
    if notes["ipcns"]:
        _cap_ipc(cfg, notes)
    if notes["mountns"]:
        # Nothing we mount from here on may leak back to the host's mount namespace.
        _mount(None, "/", None, MS_REC | MS_PRIVATE, None)


def _cap_ipc(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
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


def _files(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
    """The program's file system, in `init` (which, unlike the launcher, is in the new pid ns)."""
    workdir = cfg["workdir"]
    with open(os.path.join(workdir, "solution.py"), "rb") as f:
        code = f.read()
    os.umask(0o022)
    try:
        if "private_root" in cfg.get("unavailable", ()):
            raise OSError(errno.EPERM, "unavailable (simulated)")
        _private_root(cfg, notes, code)
        notes["private_root"] = True
        return
    except OSError as e:
        notes["private_root"] = False
        notes["private_root_error"] = str(e)
    if not cfg["allow_weak"]:
        return  # refused: see `_init`
    # Undo a partly built root (mounted over the work dir), then fall back to the host's tree.
    with contextlib.suppress(OSError):
        _call(_libc.umount2, workdir.encode(), MNT_DETACH)
    _host_view(cfg, notes, code)


def _work_tmpfs(cfg: dict[str, Any], path: str, code: bytes) -> None:
    """A size-capped tmpfs at `path`, holding solution.py and owned by the program's uid."""
    uid, gid = cfg["uid"], cfg["gid"]
    owner = f",uid={uid},gid={gid}" if uid is not None else ""
    opts = f"size={cfg['disk_bytes']},nr_inodes={cfg['max_files']},mode=0700{owner}"
    _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    with open(os.path.join(path, "solution.py"), "wb") as f:
        f.write(code)
    if uid is not None:
        os.chown(os.path.join(path, "solution.py"), uid, gid)


def _bind(source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()  # a mount point for a file
    _mount(source, target, None, MS_BIND | MS_REC, None)


def _private_root(cfg: dict[str, Any], notes: dict[str, Any], code: bytes) -> None:
    """Build the program's own root and pivot_root into it; the host's tree is then detached.

    The new root is a tmpfs mounted over the work dir's path (a directory that exists and is ours;
    the sources below are all elsewhere). It holds, at their host paths: the interpreter's
    directories and `SYSTEM_PATHS` (read-only binds), the work dir (a fresh tmpfs), /proc (a new
    proc of this pid namespace) and /dev (a tmpfs with binds of `DEV_NODES` only).
    """
    workdir: str = cfg["workdir"]
    machine = os.uname().machine
    if machine not in _SYS_PIVOT_ROOT:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown system call number on {machine}")
    root = workdir

    def inside(path: str) -> str:
        return root + path

    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    os.makedirs(inside(workdir))
    _work_tmpfs(cfg, inside(workdir), code)
    notes["tmpfs_workdir"] = True
    paths = [*cfg["expose"], *cfg.get("extra_paths", ()), *SYSTEM_PATHS]
    dirs = [p.rstrip("/") + "/" for p in paths if os.path.isdir(p) and not os.path.islink(p)]
    for path in dict.fromkeys(paths):
        if any(path.startswith(d) for d in dirs):
            continue  # inside another one (e.g. /usr/bin when the interpreter is /usr's)
        if os.path.islink(path):
            os.makedirs(os.path.dirname(inside(path)), exist_ok=True)
            if not os.path.lexists(inside(path)):
                os.symlink(os.readlink(path), inside(path))
        elif os.path.exists(path):
            _bind(path, inside(path))
    # /proc of the new pid namespace: only its own processes. Mounted by init, a member of that
    # namespace (the launcher is not). Without a pid namespace there is no /proc at all.
    if notes["pidns"]:
        os.mkdir(inside("/proc"))
        try:
            flags = MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY
            _mount("proc", inside("/proc"), "proc", flags, None)
            notes["private_proc"] = True
        except OSError as e:
            notes["private_proc_error"] = str(e)
    dev = inside("/dev")
    os.mkdir(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in DEV_NODES:
        if os.path.exists(f"/dev/{name}"):
            _bind(f"/dev/{name}", f"{dev}/{name}")
    for name, target in DEV_LINKS.items():
        os.symlink(target, f"{dev}/{name}")
    # Everything but the work dir becomes read-only (and nosuid; nodev but for the device nodes).
    for point, flags in _mounts():
        if point == inside(workdir) or not (point == root or point.startswith(root + "/")):
            continue
        flags |= MS_RDONLY | MS_NOSUID | (0 if point.startswith(dev + "/") else MS_NODEV)
        _mount(None, point, None, MS_BIND | MS_REMOUNT | flags, None)
    notes["readonly_fs"] = True
    # pivot_root(".", "."): the new root goes to "/", with the old one stacked on top of it, which
    # the detaching unmount then takes away (as runc does; see pivot_root(2)).
    os.chdir(root)
    _call(_libc.syscall, ctypes.c_long(_SYS_PIVOT_ROOT[machine]), b".", b".")
    try:
        _call(_libc.umount2, b".", MNT_DETACH)
    except OSError as e:  # not a fallback case: the host's tree would still be there
        raise RuntimeError(f"cannot detach the host's root after pivot_root: {e}") from e
    os.chdir("/")


def _host_view(cfg: dict[str, Any], notes: dict[str, Any], code: bytes) -> None:
    """The weak fallback (`allow_weak` only) when there is no private root: the host's tree,
    read-only, with a private tmpfs work dir and, given a pid namespace, a private /proc."""
    workdir, uid = cfg["workdir"], cfg["uid"]
    try:
        _work_tmpfs(cfg, workdir, code)
        notes["tmpfs_workdir"] = True
    except OSError as e:
        notes["tmpfs_workdir"] = False
        notes["tmpfs_workdir_error"] = str(e)
        _mount(workdir, workdir, None, MS_BIND, None)  # a mount of its own, so it stays writable
    if notes["pidns"]:
        try:
            _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
            notes["private_proc"] = True
        except OSError as e:
            notes["private_proc_error"] = str(e)
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
    cap(resource.RLIMIT_MSGQUEUE, 0)  # POSIX message queues: kernel memory, outside RLIMIT_AS


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
    if notes["seccomp"]:
        _install_seccomp(deny_memfd=not notes.get("memory_cgroup"))
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
    if notes["mountns"]:
        _files(cfg, notes)
    machine = os.uname().machine
    notes["seccomp"] = machine in _SYSCALLS and "seccomp" not in cfg.get("unavailable", ())
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
            _become_user(cfg, notes, info_fd)
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


def _join_cgroup(cfg: dict[str, Any], notes: dict[str, Any]) -> None:
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
        _join_cgroup(cfg, notes)
        if os.geteuid() == 0:
            _unshare(cfg, notes)
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
