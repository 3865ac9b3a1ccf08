"""TensorBoard: one scalar per metric, at the run step, in an event file TensorBoard reads live.

Written with tensorboard's own event-file writer (no TensorFlow, no torch), as classic scalar
summaries: `tensorboard --logdir RUN_DIR/tensorboard` and EventAccumulator.Scalars read them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog

from miles.sinks.common import require, scalars
from miles.sinks.config import TensorBoardConfig

log = structlog.get_logger(__name__)


class TensorBoardSink:
    def __init__(self, config: TensorBoardConfig, run_dir: str) -> None:
        require("tensorboard", "tensorboard")
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self.log_dir = config.log_dir or str(Path(run_dir) / "tensorboard")
        self._writer: Any = EventFileWriter(self.log_dir)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        values = [
            self._summary.Value(tag=key, simple_value=float(value))
            for key, value in scalars(metrics).items()
        ]
        event = self._event(wall_time=time.time(), step=step, summary=self._summary(value=values))
        self._writer.add_event(event)
        self._writer.flush()  # steps are seconds apart: a live TensorBoard sees each one at once

    def close(self) -> None:
        try:
            self._writer.close()
        except Exception as exc:  # the controller closes sinks while finishing the run
            log.warning("tensorboard sink: closing failed", error=repr(exc))
