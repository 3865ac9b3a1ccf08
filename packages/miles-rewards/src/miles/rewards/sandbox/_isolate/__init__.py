"""The launcher's isolation steps (see `_launcher.py`), one module per idea.

Standard library only, and relative imports only: the launcher runs as a script, in isolated mode
and without miles on its path, and imports this directory as the top-level package `_isolate`.
Within miles (tests, type checking) it is `miles.rewards.sandbox._isolate`.

    kernel      the libc calls and flags everything below uses
    namespaces  in the launcher: the memory cgroup, the namespaces, the IPC caps
    rootfs      in `init`: the program's own root file system, then pivot_root
    hostview    in `init`: the weak fallback, the host's tree read-only
    mounts      what both of those build with: the mount table, binds, the work dir's tmpfs
    user        in `user`: limits, environment, dropped privileges, then seccomp
    seccomp     the system call filter
"""
