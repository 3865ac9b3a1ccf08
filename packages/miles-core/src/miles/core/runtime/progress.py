"""The console progress bar of `miles run`: step, reward, step time and ETA."""

from __future__ import annotations

import os

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self.bar = tqdm(
            total=total,
            initial=start,
            desc="RL steps",
            unit="step",
            disable=not enabled or total == 0,
            dynamic_ncols=True,
            mininterval=0 if os.environ.get("CI") else 0.1,
        )

    def update(self, metrics: dict[str, float]) -> None:
        self.bar.set_postfix(
            reward=f"{metrics.get('rollout/reward_mean', 0.0):.3f}",
            step_s=f"{metrics.get('perf/step_s', 0.0):.2f}",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
