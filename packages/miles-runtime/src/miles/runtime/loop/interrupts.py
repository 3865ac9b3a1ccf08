"""Ctrl-C during the RL loop: the first press finishes the step in flight, saves a checkpoint of
it and stops (so `miles run --resume` continues from there); a second press stops at once.

Ray's own processes block SIGINT, so a terminal's Ctrl-C reaches only the driver: the actors
finish what they were asked and wait.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any


class RunInterrupted(Exception):
    """The run stopped at a person's request after `steps_done` of `steps` steps, with a
    checkpoint of the last one (None: it had none to save)."""

    def __init__(self, steps_done: int, steps: int, checkpoint: str | None) -> None:
        super().__init__(f"interrupted after step {steps_done} of {steps}")
        self.steps_done, self.steps, self.checkpoint = steps_done, steps, checkpoint


class GracefulInterrupt:
    """While entered (on the main thread), SIGINT sets `requested` and says what happens next
    through `say`; a second SIGINT raises KeyboardInterrupt as usual."""

    def __init__(self, say: Callable[[str], None], step_in_flight: Callable[[], int]) -> None:
        self.requested = False
        self._say, self._step_in_flight = say, step_in_flight
        self._previous: Any = None

    def __enter__(self) -> GracefulInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _on_sigint(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.requested = True
        step = self._step_in_flight()
        self._say(
            f"interrupt: finishing step {step}, then saving a checkpoint and stopping "
            f"(Ctrl-C again stops at once; step {step} is then lost)"
        )
