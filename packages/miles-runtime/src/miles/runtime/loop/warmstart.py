"""The optional SFT warm-start, through the run's train backend.

A train group lost during it starts again from model.path and trains the warm-start steps so far
again on the same batches (Ray object references the controller keeps), then goes on.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import structlog
from ray import ObjectRef

from miles.core.config import WarmstartConfig
from miles.core.contracts.types import PackedBatch
from miles.core.observability.telemetry import carrier, span
from miles.runtime.actors.train_group import TrainerDied, TrainGroup, retrying

if TYPE_CHECKING:
    from miles.runtime.rollout.rollout_manager import RolloutHandle

log = structlog.get_logger(__name__)


def warm_start(ws: WarmstartConfig, trainers: TrainGroup, rollout: RolloutHandle) -> int:
    """Runs `ws.steps` SFT steps; returns how many were redone after a lost train group."""
    log.info("warm-start (SFT)", steps=ws.steps, batch_size=ws.batch_size)
    batches: list[ObjectRef[PackedBatch]] = []
    redone = 0

    def step(i: int) -> dict[str, float]:
        with span("miles.warmstart", step=i):
            return dict(trainers.warmstart_step(batches[i], i, carrier()))

    def recover(error: TrainerDied) -> None:
        nonlocal redone
        trainers.restart(error, None)
        for j in range(len(batches) - 1):
            step(j)
        redone += len(batches) - 1
        log.warning(
            "train group restored",
            fault="train_restarted",
            step=-1,
            restored="the base model (warm-start)",
            steps_redone=len(batches) - 1,
            lost_training=False,
        )

    first_loss = None
    for i in range(ws.steps):
        batches.append(rollout.sft_batch.remote(ws.batch_size))
        metrics = retrying(f"warm-start step {i}", functools.partial(step, i), recover)
        loss = round(metrics["train/loss"], 4)
        first_loss = loss if first_loss is None else first_loss
        if i == 0 or (i + 1) % 10 == 0 or i + 1 == ws.steps:
            # Progress detail: events.jsonl keeps it; the console gets the summary below.
            log.info("warm-start step", step=i + 1, loss=loss, _quiet=True)
    if ws.steps:
        log.info("warm-start done", steps=ws.steps, loss=loss, first_loss=first_loss)
    return redone
