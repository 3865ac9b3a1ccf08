"""`miles serve` whose engine takes at least MILES_TEST_STEP_DELAY_S per model step, as a larger
model would: a batch then outlasts a train step of the tiny test model, so a weight update
reliably finds requests in flight. With MILES_TEST_FULL_LENGTH=1 an end-of-sequence token does
not end an answer (only max_new_tokens does), as with SGLang's ignore_eos: the random test
model's answers end after about 10 tokens, and some batches ended before the update.
Run as `python slow_serve.py serve MODEL ...`."""

from __future__ import annotations

import os
import time

from miles.core.cli import main
from miles.torch.engine.engine import TorchRolloutEngine
from miles.torch.engine.paged.runner import PagedRunner

_delay = float(os.environ.get("MILES_TEST_STEP_DELAY_S", "0.05"))
_step = PagedRunner.step


def _slow_step(self: PagedRunner) -> None:
    time.sleep(_delay)
    _step(self)


PagedRunner.step = _slow_step  # type: ignore[method-assign]

# One token per step, as SGLang's scheduler decodes (not a burst of engine.decode_burst steps in
# one call): a request that arrives mid-batch is prefilled 0.1 s later, not after the burst.
PagedRunner._burst_length = lambda self, seqs: 1  # type: ignore[method-assign]

if os.environ.get("MILES_TEST_FULL_LENGTH") == "1":
    _finish_reason = TorchRolloutEngine._finish_reason

    def _length_only(self: TorchRolloutEngine, row):  # type: ignore[no-untyped-def]
        reason = _finish_reason(self, row)
        return None if reason == "stop" else reason

    TorchRolloutEngine._finish_reason = _length_only  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
