"""How `miles run` shows its progress: on a terminal, a bar (step, reward, step time, ETA); when
stderr is not a terminal (a pipe, `tee`, CI, nohup), a plain `step` log line every
`LINE_EVERY_S` seconds and at the last step, so no bar is glued into the log lines."""

from __future__ import annotations

import sys
import time

import structlog
from tqdm import tqdm

log = structlog.get_logger(__name__)

LINE_EVERY_S = 10.0


class Progress:
    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.total, self.done = total, start
        self.interactive = enabled and sys.stderr.isatty()
        self.lines = enabled and not self.interactive and total > 0
        self.bar = tqdm(
            total=total,
            initial=start,
            desc="RL steps",
            unit="step",
            disable=not self.interactive or total == 0,
            dynamic_ncols=True,
            mininterval=0.1,
        )
        self._started = self._last_line = time.monotonic()
        self._start = start

    def update(self, metrics: dict[str, float]) -> None:
        self.done += 1
        reward = metrics.get("rollout/reward_mean", 0.0)
        step_s = metrics.get("perf/step_s", 0.0)
        if self.interactive:
            self.bar.set_postfix(reward=f"{reward:.3f}", step_s=f"{step_s:.2f}", refresh=False)
            self.bar.update(1)
            return
        now = time.monotonic()
        if self.lines and (now - self._last_line >= LINE_EVERY_S or self.done == self.total):
            self._last_line = now
            rate = (now - self._started) / max(self.done - self._start, 1)
            log.info(
                "step",
                step=f"{self.done}/{self.total}",
                reward=round(reward, 4),
                step_s=round(step_s, 2),
                eta_s=round(rate * (self.total - self.done)),
            )

    def write(self, message: str) -> None:
        """A line of its own, above the bar (or on stderr when there is no bar)."""
        tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
