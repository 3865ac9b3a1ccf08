"""`miles serve` whose engine takes at least MILES_TEST_STEP_DELAY_S per model step, as a larger
model would: a batch then outlasts a train step of the tiny test model, so a weight update
reliably finds requests in flight. Run as `python slow_serve.py serve MODEL ...`."""

from __future__ import annotations

import os
import time

from miles.core.cli import main
from miles.torch.engine.paged.runner import PagedRunner

_delay = float(os.environ.get("MILES_TEST_STEP_DELAY_S", "0.05"))
_step = PagedRunner.step


def _slow_step(self: PagedRunner) -> None:
    time.sleep(_delay)
    _step(self)


PagedRunner.step = _slow_step  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
