"""MLflow: one MLflow run per Miles run, each metric logged at ``step=`` the run step.

The MLflow run opens at the first log() rather than when the sink is built: building happens in
the controller before training starts, and a tracking store that is unreachable or unusable then
fails a log() call, which the controller answers by switching this sink off while the run goes on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog

from miles.sinks.common import require, scalars
from miles.sinks.config import MlflowConfig

log = structlog.get_logger(__name__)

_BATCH = 1000  # MLflow's limit on metrics per log_batch call


def default_tracking_uri(run_dir: str) -> str:
    return f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}"


class MlflowSink:
    def __init__(self, config: MlflowConfig, run_dir: str) -> None:
        require("mlflow", "mlflow")
        self.config, self.run_dir = config, Path(run_dir)
        self.tracking_uri = config.tracking_uri or default_tracking_uri(run_dir)
        self.run_id: str | None = None
        self._client: Any = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            self._start()
        now_ms = int(time.time() * 1000)
        rows = [Metric(k, float(v), now_ms, step) for k, v in scalars(metrics).items()]
        for i in range(0, len(rows), _BATCH):
            self._client.log_batch(self.run_id, metrics=rows[i : i + _BATCH])

    def close(self) -> None:
        if self.run_id is None:
            return
        try:
            self._client.set_terminated(self.run_id)
        except Exception as exc:  # the controller closes sinks while finishing the run
            log.warning("mlflow sink: ending the run failed", error=repr(exc))

    def _start(self) -> None:
        from mlflow.tracking import MlflowClient

        experiment = self.config.experiment
        try:
            client = MlflowClient(self.tracking_uri)
            experiment_id = _experiment_id(client, experiment, self._artifact_location())
            run = client.create_run(
                experiment_id,
                run_name=self.config.run_name or self.run_dir.name,
                tags={"miles.run_dir": str(self.run_dir.resolve())},
            )
        except Exception as exc:  # MLflow's own errors often omit the store (a bare OSError)
            raise RuntimeError(
                f"cannot open an MLflow run in experiment {experiment!r} at "
                f"{self.tracking_uri!r}: {exc!r}"
            ) from exc
        self._client, self.run_id = client, run.info.run_id

    def _artifact_location(self) -> str | None:
        """Our own store keeps its artifacts in the run dir too; a server decides for itself."""
        if self.config.tracking_uri is not None:
            return None
        return (self.run_dir / "mlartifacts").resolve().as_uri()


def _experiment_id(client: Any, name: str, artifact_location: str | None) -> str:
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(client.create_experiment(name, artifact_location=artifact_location))
    except MlflowException:  # another run created it meanwhile
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)
