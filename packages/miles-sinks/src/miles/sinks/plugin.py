"""miles-sinks' plugin module: the metric sinks it registers.

Factories are lazy: listing plugins or checking a config imports none of the backends.
"""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import ComponentSpec, Kind, hookimpl, lazy
from miles.sinks.config import MlflowConfig, TensorBoardConfig, WandbConfig


@hookimpl
def miles_register_metric_sinks() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.METRIC_SINK,
            "tensorboard",
            lazy("miles.sinks.tensorboard:TensorBoardSink"),
            "TensorBoard scalars (event files in RUN_DIR/tensorboard)",
            TensorBoardConfig,
        ),
        ComponentSpec(
            Kind.METRIC_SINK,
            "wandb",
            lazy("miles.sinks.wandb:WandbSink"),
            "a Weights & Biases run (online, or offline files in RUN_DIR/wandb)",
            WandbConfig,
        ),
        ComponentSpec(
            Kind.METRIC_SINK,
            "mlflow",
            lazy("miles.sinks.mlflow:MlflowSink"),
            "an MLflow run (a tracking server, or a SQLite store in RUN_DIR)",
            MlflowConfig,
        ),
    ]
