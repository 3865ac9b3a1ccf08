"""A deadline for joining a trainer's TCP store.

torch's TCPStore client honours its timeout while it connects, but not in the handshake after:
against a peer whose kernel completed the connection and that never answers (a trainer process
that hung, a port that listens and never accepts), `TCPStore(...)` blocks in a `recv` forever.
Nothing in torch can interrupt it, so at the deadline we shut down the sockets it opened to that
peer: the `recv` returns, torch raises, and the caller's thread is free.

Linux only (it reads /proc/self/net); elsewhere the store's own timeout is all there is.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_TABLES = (Path("/proc/self/net/tcp"), Path("/proc/self/net/tcp6"))


def within_deadline(host: str, port: int, seconds: float, connect: Callable[[], T]) -> T:
    """`connect()`, whose sockets to `host:port` opened in the meantime are shut down if it has
    not returned after `seconds` (then TimeoutError, whatever torch raised)."""
    before = _socket_inodes_to(host, port)
    lock = threading.Lock()
    state = {"returned": False, "cut": False}

    def expire() -> None:
        with lock:  # a store that connected just now is left alone
            if state["returned"]:
                return
            state["cut"] = True
        _shut_new_sockets(host, port, before)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        store = connect()
    except Exception as exc:
        if state["cut"]:
            raise TimeoutError(f"no answer from {host}:{port} within {seconds:.0f} s") from exc
        raise
    finally:
        timer.cancel()
    with lock:
        state["returned"] = True
        cut = state["cut"]
    if cut:  # connected as its sockets were being cut: not a store to use
        raise TimeoutError(f"no answer from {host}:{port} within {seconds:.0f} s")
    return store


def _shut_new_sockets(host: str, port: int, keep: set[str]) -> None:
    stuck = _socket_inodes_to(host, port) - keep
    for fd in _fds_of(stuck):
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
            finally:
                sock.close()  # closes our duplicate; torch's descriptor stays its own


def _socket_inodes_to(host: str, port: int) -> set[str]:
    """Inodes of this process's TCP sockets whose remote end is `host:port`."""
    try:
        wanted = {ipaddress.ip_address(info[4][0]) for info in socket.getaddrinfo(host, port)}
    except (OSError, ValueError):
        return set()
    inodes = set()
    for table in _TABLES:
        with contextlib.suppress(OSError):
            for line in table.read_text().splitlines()[1:]:
                fields = line.split()
                address, _, remote_port = fields[2].partition(":")
                if int(remote_port, 16) == port and _decode(address) in wanted:
                    inodes.add(fields[9])
    return inodes


def _decode(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order;
    an IPv4-mapped IPv6 address comes back as the IPv4 one."""
    raw = bytes.fromhex(hex_address)
    ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    if len(ordered) == 4:
        return ipaddress.IPv4Address(ordered)
    address = ipaddress.IPv6Address(ordered)
    return address.ipv4_mapped or address


def _fds_of(inodes: set[str]) -> Iterator[int]:
    if not inodes:
        return
    for entry in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            link = os.readlink(entry)
            if link.startswith("socket:[") and link[8:-1] in inodes:
                yield int(entry.name)
