"""Weights & Biases: one wandb run per Miles run, each step's metrics at ``step=`` the run step.

The run's config.yaml, when the run directory has one, becomes the wandb run's config, so the
hyperparameters show next to the curves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
import yaml

from miles.sinks.common import require, scalars
from miles.sinks.config import WandbConfig

log = structlog.get_logger(__name__)


class WandbSink:
    def __init__(self, config: WandbConfig, run_dir: str) -> None:
        wandb = require("wandb", "wandb")
        files_dir = Path(config.dir or run_dir)
        files_dir.mkdir(parents=True, exist_ok=True)  # wandb falls back to /tmp when it is missing
        self.run: Any = wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or Path(run_dir).name,
            mode=config.mode,
            dir=str(files_dir),
            tags=config.tags or None,
            config=_run_config(Path(run_dir)),
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.run.log(scalars(metrics), step=step)

    def close(self) -> None:
        try:
            self.run.finish()
        except Exception as exc:  # the controller closes sinks while finishing the run
            log.warning("wandb sink: finishing the run failed", error=repr(exc))


def _run_config(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "config.yaml"
    if not path.is_file():
        return None
    loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    return loaded if isinstance(loaded, dict) else None
