"""The seccomp filter the `user` process installs last, before the program runs.

It refuses, with EPERM, the system calls the program has no use for: new namespaces (user
namespaces included), keyrings (state that would outlive the run), mounts, BPF, io_uring,
userfaultfd, perf events and kernel modules; and memfd_create where no cgroup counts its pages.
"""

from __future__ import annotations

import ctypes
import errno
import os

from .kernel import call, libc

# System calls the program has no use for, refused with EPERM. Per architecture: (the audit
# architecture seccomp reports, {name: number}).
DENIED = [
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
SYSCALLS = {
    "x86_64": (0xC000003E, dict(zip(
        [*DENIED, "memfd_create", "clone", "clone3"],
        [272, 308, 250, 248, 249, 321, 323, 298, 425, 426, 427, 165, 166, 155, 428, 429, 430,
         431, 432, 433, 442, 246, 175, 313, 176, 447, 319, 56, 435], strict=True,
    ))),
    "aarch64": (0xC00000B7, dict(zip(
        [*DENIED, "memfd_create", "clone", "clone3"],
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


def filter_program(machine: str, deny_memfd: bool) -> list[tuple[int, int, int, int]]:
    """The classic-BPF filter, as (code, jt, jf, k) instructions."""
    arch, numbers = SYSCALLS[machine]
    denied = [numbers[name] for name in DENIED]
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


def install(deny_memfd: bool) -> None:
    """Install the filter on this process (and so on everything it starts). Needs no_new_privs."""
    ops = filter_program(os.uname().machine, deny_memfd)
    filters = (_SockFilter * len(ops))(*[_SockFilter(*op) for op in ops])
    fprog = _SockFprog(len(ops), filters)
    call(libc.prctl, PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0)
