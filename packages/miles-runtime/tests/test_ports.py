"""The weight-sync port is held from the moment it is picked until its server listens."""

from __future__ import annotations

import socket

import pytest

from miles.runtime.cluster.process import free_port, reserve_port


def test_a_reserved_port_is_refused_to_others_but_taken_by_a_reuse_address_server() -> None:
    held = reserve_port()
    port = held.getsockname()[1]
    try:
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("", port))  # another run picking "its" port explicitly
        assert all(free_port() != port for _ in range(200))  # nor handed out as a free one
        with socket.socket() as server:  # what the trainer's TCPStore does, in this process
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("", port))
            server.listen()
            held.close()
            with socket.socket() as late, pytest.raises(OSError):
                late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                late.bind(("", port))  # listening now: nobody else binds it
    finally:
        held.close()
