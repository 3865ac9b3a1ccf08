"""The typed config section of rollout backend `sglang` (the `rollout:` section's other keys).
No torch or HTTP import: listing plugins stays cheap."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

MIN_SGLANG = "0.5"  # the release whose protocol the client speaks


@dataclass
class SGLangConfig:
    # Running servers to attach to (SGLang or `miles serve`), one per engine: rollout.engines
    # must equal their number. Empty: each engine launches its own server (`server`).
    urls: list[str] = field(default_factory=list)
    # What an engine launches when `urls` is empty: SGLang (`pip install 'miles-sglang[server]'`)
    # or `miles serve` (the torch engine behind the same protocol, in a process of its own).
    server: Literal["sglang", "miles"] = "sglang"
    # Flags for a launched server, passed through: {tp_size: 2, mem_fraction_static: 0.8}.
    server_args: dict[str, Any] = field(default_factory=dict)
    # Seconds a launched server may take to load and answer /health_generate.
    startup_timeout_s: float = 900.0
    # Sent as 'Authorization: Bearer KEY' when the servers require one.
    api_key: str | None = None
    # Requests one engine keeps in flight at once.
    max_in_flight: int = 64
    # Seconds one HTTP call may take (a weight-sync call waits for its broadcasts).
    request_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.urls = [u.rstrip("/") for u in self.urls]
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.server not in ("sglang", "miles"):
            raise ValueError(f"server must be 'sglang' or 'miles', got {self.server!r}")
        if self.urls and self.server_args:
            raise ValueError(
                "server_args are flags for servers Miles launches; with urls the servers are "
                "yours: start them with those flags instead"
            )
        if self.startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {self.startup_timeout_s}")
