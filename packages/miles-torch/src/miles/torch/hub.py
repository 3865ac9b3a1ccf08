"""A model.path that is a Hugging Face hub id: checked before launch that it can be had.

Without this, a machine that cannot reach the hub learns it inside an actor, as a connection
error under Ray's traceback, after Ray and every actor started.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def check_hub_model(model_path: str, timeout_s: float = 5.0) -> None:
    """Raises OSError (saying what to do) when `model_path` is a hub id that is neither in the
    local Hugging Face cache nor reachable: offline mode, or the hub's host not answering."""
    if not _HUB_ID.match(model_path) or Path(model_path).exists():
        return
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(model_path, "config.json"), str):
        return  # downloaded before: the actors load it from the cache
    fix = (
        f"download it where there is network (huggingface-cli download {model_path} --local-dir "
        "DIR), then pass --set model.path=DIR"
    )
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        raise OSError(
            f"{model_path!r} is not in the Hugging Face cache and HF_HUB_OFFLINE is set: {fix}"
        )
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        raise OSError(
            f"{model_path!r} is not a local checkpoint nor in the Hugging Face cache, and the hub "
            f"({host}:{port}) cannot be reached from here ({exc.strerror or exc}): {fix}"
        ) from None
