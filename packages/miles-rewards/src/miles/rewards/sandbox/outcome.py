"""How a run ended, in a `SandboxResult`: the launcher's report, read against what the parent saw.

The parent knows whether it killed the run (wall clock, output cap) and what the program wrote;
the launcher reports how far the sandbox got and how the program exited; the memory cgroup, if
any, whether the kernel killed something for the run's memory.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from miles.rewards.sandbox.datatypes import SandboxLimits, SandboxResult, Status
from miles.rewards.sandbox.errors import SandboxError, SandboxUnavailable, refusal
from miles.rewards.sandbox.memory_cgroup import MemoryCgroup
from miles.rewards.sandbox.processes import survivors

# A SIGKILL after at least this share of the CPU-time limit is the limit's (see `classify`).
CPU_LIMIT_SHARE = 0.8


@dataclass
class Outcome:
    """Why the parent ended the run, if it did."""

    timed_out: bool = False
    output_over: bool = False


@dataclass
class Finished:
    """What the parent saw of a run, once every process of it is gone."""

    pgid: int
    returncode: int | None  # the launcher's
    stdout: bytes
    stderr: bytes
    wall_s: float
    swept: int  # processes the cleanup had to kill
    pipes_closed: bool
    outcome: Outcome = field(default_factory=Outcome)


def make_result(
    info: dict[str, Any],
    run: Finished,
    limits: SandboxLimits,
    uid: int | None,
    cgroup: MemoryCgroup | None,
) -> SandboxResult:
    """The result of a run, from the launcher's report `info`; raises if the sandbox failed."""
    oom_killed = cgroup is not None and cgroup.oom_kills() > 0
    if oom_killed and "end" not in info and "fatal" not in info and "refused" not in info:
        # The kernel chose a process of the sandbox itself (launcher or init) to kill for the
        # run's memory: it picks by resident size, and the program's memfd or shared-memory
        # pages count for no process. Still the program's doing; init's report died with it.
        info["end"] = {"exit_code": -signal.SIGKILL, "cpu_s": 0.0}
        info.setdefault("ready", True)
    if "refused" in info:
        raise SandboxUnavailable(refusal(info["refused"], info.get("setup", {})))
    outcome = run.outcome
    if "fatal" in info or ("end" not in info and not (outcome.timed_out or outcome.output_over)):
        raise SandboxError(
            f"the sandbox failed to start the program (launcher exit {run.returncode}): "
            f"{info.get('fatal') or run.stderr.decode(errors='replace')[-2000:]}"
        )
    end = info.get("end", {})
    exit_code = end.get("exit_code")
    status, reason = classify(exit_code, end.get("cpu_s", 0.0), run.stderr, outcome, limits)
    if oom_killed and status not in ("timeout", "output_limit"):
        status = "memory"
        reason = (
            f"memory limit of {limits.memory_mb} MiB reached (the run's memory cgroup, which "
            "counts shared memory and memfd pages too); killed"
        )
    if "end" in info and "ready" not in info:
        # The user process failed before the program started (e.g. setuid refused).
        raise SandboxError(f"sandbox setup failed: {run.stderr.decode(errors='replace')[-2000:]}")
    if run.swept:
        reason = f"{reason}; cleanup killed {run.swept} leftover process(es)".lstrip("; ")
    return SandboxResult(
        status=status,
        exit_code=exit_code,
        stdout=run.stdout.decode(errors="replace"),
        stderr=run.stderr.decode(errors="replace"),
        wall_s=run.wall_s,
        contained=run.pipes_closed and not survivors(run.pgid, uid),
        reason=reason,
        isolation=isolation(info.get("setup", {}), uid, cgroup),
    )


def classify(
    exit_code: int | None, cpu_s: float, stderr: bytes, outcome: Outcome, limits: SandboxLimits
) -> tuple[Status, str]:
    """The run's status, and why, in words ("" when it is "ok")."""
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


def isolation(
    setup: dict[str, Any], uid: int | None, cgroup: MemoryCgroup | None
) -> tuple[str, ...]:
    """The mechanisms in force (`SandboxResult.isolation`), from the launcher's setup notes."""
    steps = ("netns", "pidns", "mountns", "ipcns", "private_root", "private_proc", "tmpfs_workdir")
    names = [k for k in (*steps, "readonly_fs", "ipc_capped", "seccomp") if setup.get(k)]
    if not setup.get("netns"):
        names.append("socket_guard")
    if uid is not None:
        names.append("uid")
    if cgroup is not None and setup.get("memory_cgroup"):
        names.append(f"memory_cgroup_v{cgroup.version}")
    return (*names, "rlimits", "session")
