"""What a sandboxed run may use (`SandboxLimits`) and how it ended (`SandboxResult`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed"]


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0  # wall-clock time, from start to the last process gone
    cpu_s: int | None = None  # CPU seconds of the program (RLIMIT_CPU); None: ceil(wall_s)
    memory_mb: int = 256  # address space (RLIMIT_AS) of each process
    file_size_mb: int = 16  # largest file the program may write (RLIMIT_FSIZE)
    disk_mb: int = 64  # total size of the work dir, when it can be a private tmpfs
    max_files: int = 1024  # inodes in that tmpfs
    max_processes: int = 16  # processes and threads (RLIMIT_NPROC, per sandbox uid)
    max_open_files: int = 64  # RLIMIT_NOFILE
    max_output_bytes: int = 1 << 20  # each of stdout and stderr; the run is killed past it

    def __post_init__(self) -> None:
        if self.wall_s <= 0 or self.memory_mb <= 0 or self.max_processes < 1:
            raise ValueError(f"invalid sandbox limits: {self}")

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_s if self.cpu_s is not None else max(1, math.ceil(self.wall_s))


@dataclass(frozen=True)
class SandboxResult:
    status: Status
    exit_code: int | None  # the program's exit code; negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    contained: bool  # every process of the run is gone, none escaped the cleanup
    reason: str  # why the run ended as it did, in words ("" when status is "ok")
    # The mechanisms that were in force, e.g. ("netns", "pidns", "readonly_fs", "uid", ...).
    isolation: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return self.status == "ok"
