"""How much memory one GPU has: from the user's words, or from this machine."""

from __future__ import annotations

import shutil
import subprocess

GB = 1e9


class MemoryParseError(ValueError):
    pass


def parse_memory(text: str) -> float:
    """'141GB', '141 GiB', '80G' or '141' (GB) -> gigabytes (1e9 bytes)."""
    raw = text.strip().lower().replace(" ", "")
    for suffix, factor in (("gib", 2**30 / GB), ("gb", 1.0), ("g", 1.0), ("tb", 1e3)):
        if raw.endswith(suffix):
            raw, scale = raw[: -len(suffix)], factor
            break
    else:
        scale = 1.0
    try:
        value = float(raw) * scale
    except ValueError:
        raise MemoryParseError(
            f"GPU memory {text!r}: expected a size like 141GB or 80GiB"
        ) from None
    if value <= 0:
        raise MemoryParseError(f"GPU memory {text!r} must be positive")
    return value


def local_gpu_memory_gb() -> float | None:
    """This machine's first GPU's memory (from nvidia-smi: the controller needs no CUDA), or
    None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        return float(out.splitlines()[0]) * 2**20 / GB  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
