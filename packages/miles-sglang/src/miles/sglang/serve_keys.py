"""The key that guards a `miles serve` server's control and weight endpoints.

A server started without `--api-key` makes a random key and writes it where only its user can
read it: `$MILES_CACHE_DIR/serve/HOST-PORT.key`. A client on the same machine (the `sglang`
rollout backend attached to it, a test, `curl -H "Authorization: Bearer $(cat FILE)"`) reads it
from there; nobody else who reaches the port, a web page in a local browser included, can pause
the server, free its memory or replace its weights.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from urllib.parse import urlsplit

from miles.core.cache import cache_dir

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def key_file(host: str, port: int) -> Path:
    return cache_dir("serve") / f"{host}-{port}.key"


def write_key(host: str, port: int) -> tuple[str, Path]:
    """A fresh random key in this server's key file (mode 0600; any older one replaced)."""
    key = secrets.token_urlsafe(32)
    path = key_file(host, port)
    os.chmod(path.parent, 0o700)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return key, path


def key_for_url(url: str) -> str | None:
    """The key a local `miles serve` at `url` wrote, if this user can read one."""
    parts = urlsplit(url)
    if parts.hostname not in LOOPBACK or parts.port is None:
        return None
    for host in dict.fromkeys((parts.hostname, "127.0.0.1")):
        path = cache_dir("serve") / f"{host}-{parts.port}.key"
        try:
            return path.read_text().strip() or None
        except OSError:
            continue
    return None
