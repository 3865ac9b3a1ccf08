"""The typed config section of rollout backend `sglang` (the `rollout:` section's other keys).
No torch or HTTP import: listing plugins stays cheap."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SGLangConfig:
    # Running servers to attach to (SGLang or `miles serve`), one per engine: rollout.engines
    # must equal their number.
    urls: list[str] = field(default_factory=list)
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
