"""Watching a started launcher: stdin fed, output read up to its cap, the wall clock enforced,
and afterwards every process of the run killed and its pipes closed."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time

from miles.rewards.sandbox.datatypes import SandboxLimits
from miles.rewards.sandbox.outcome import Finished, Outcome
from miles.rewards.sandbox.pipes import feed, read_capped, wait_exit
from miles.rewards.sandbox.processes import kill_group, sweep


async def supervise(
    proc: subprocess.Popen[bytes], stdin: str, limits: SandboxLimits, uid: int | None, start: float
) -> Finished:
    """Run `proc` (the launcher, started at `start`) to its end, or kill it at a limit."""
    assert proc.stdin and proc.stdout and proc.stderr
    pgid = proc.pid
    outcome = Outcome()
    over = asyncio.Event()
    cap = limits.max_output_bytes
    out_buf, err_buf = bytearray(), bytearray()
    feeder = asyncio.create_task(feed(proc.stdin, stdin.encode()))
    out = asyncio.create_task(read_capped(proc.stdout.fileno(), cap, over, out_buf))
    err = asyncio.create_task(read_capped(proc.stderr.fileno(), cap, over, err_buf))
    waiter = asyncio.create_task(wait_exit(proc))
    over_wait = asyncio.create_task(over.wait())
    try:
        done, _ = await asyncio.wait(
            {waiter, over_wait}, timeout=limits.wall_s, return_when=asyncio.FIRST_COMPLETED
        )
        if waiter not in done:
            outcome.output_over = over.is_set()
            outcome.timed_out = not outcome.output_over
            kill_group(pgid)
        await waiter
        swept = await sweep(pgid, uid)
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
            kill_group(pgid)
            proc.wait()  # SIGKILL-ed: returns at once; no zombie is left behind
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            with contextlib.suppress(OSError):
                pipe.close()
    return Finished(pgid, proc.returncode, stdout, stderr, wall_s, swept, pipes_closed, outcome)
