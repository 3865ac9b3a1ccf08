"""The sinks' typed config sections (their options in ``telemetry.sinks``).

Each checks that its backend is installed, so `miles run` reports a missing package as a config
error naming the key path, before Ray or any worker starts. No backend is imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from miles.sinks.common import check_installed


@dataclass
class TensorBoardConfig:
    log_dir: str | None = None  # default: RUN_DIR/tensorboard

    def __post_init__(self) -> None:
        check_installed("tensorboard", "tensorboard")


@dataclass
class WandbConfig:
    project: str = "miles"
    entity: str | None = None  # default: the API key's default entity
    name: str | None = None  # default: the run directory's name
    # None leaves it to wandb: WANDB_MODE when set, else online.
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None  # where wandb keeps its files; default: RUN_DIR
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_installed("wandb", "wandb")


@dataclass
class MlflowConfig:
    # Default: a SQLite store in RUN_DIR/mlflow.db (artifacts in RUN_DIR/mlartifacts). MLflow 3
    # refuses plain file stores (file:./mlruns) unless MLFLOW_ALLOW_FILE_STORE=true is set.
    tracking_uri: str | None = None
    experiment: str = "miles"
    run_name: str | None = None  # default: the run directory's name

    def __post_init__(self) -> None:
        check_installed("mlflow", "mlflow")
