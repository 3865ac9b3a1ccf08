"""The run's pipes, from the event loop: stdin fed, stdout/stderr read up to a cap, the exit
awaited, and the launcher's report read once it is done.

Raw non-blocking fds and loop readers rather than asyncio subprocesses: in Python 3.11,
`Process.wait()` also waits for every pipe to close, which a capped (no longer read) stdout never
does, and the readers here must be able to stop reading at the cap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
from typing import IO, Any

CHUNK = 1 << 16


async def read_capped(fd: int, cap: int, over: asyncio.Event, buf: bytearray) -> None:
    """Read `fd` to EOF into `buf`, up to `cap` + 1 bytes; set `over` (and stop) past the cap."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def on_readable() -> None:
        try:
            chunk = os.read(fd, CHUNK)
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


async def feed(pipe: IO[bytes], data: bytes) -> None:
    """Write `data` to `pipe` as the program reads it, then close it (EOF)."""
    fd = pipe.fileno()
    loop = asyncio.get_running_loop()
    view = memoryview(data)
    done = loop.create_future()

    def on_writable() -> None:
        nonlocal view
        try:
            view = view[os.write(fd, view[:CHUNK]) :]
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


async def wait_exit(proc: subprocess.Popen[bytes]) -> int:
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


def read_info(fd: int) -> dict[str, Any]:
    """The launcher's JSON lines: {"setup": {...}}, {"end": {...}} or {"fatal": "traceback"}."""
    os.set_blocking(fd, False)
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, CHUNK):
            data += chunk
    info: dict[str, Any] = {}
    for line in data.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            info.update(json.loads(line))
    return info
