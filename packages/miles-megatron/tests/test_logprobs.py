"""Vocabulary-parallel logprobs and entropy against a full-vocabulary log-softmax (fp64),
values and gradients, on 1, 2 and 4 gloo CPU ranks with Megatron's padded vocabulary."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# End-to-end runs: each test's own time limit (the suite's default is for unit tests).
pytestmark = pytest.mark.timeout(600)

SCRIPT = Path(__file__).with_name("vocab_parallel_check.py")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_logprobs_match_the_full_softmax(tp: int) -> None:
    env = {**os.environ, "MILES_TEST_PORT": str(29900 + tp * 7 + os.getpid() % 50)}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(tp)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in results) == list(range(tp))
    for r in results:
        # fp32 arithmetic against an fp64 reference: errors of order 1e-6 of the scale.
        assert max(r[k] for k in ("logprob", "entropy", "grad_hidden", "grad_weight")) < 1e-4, r
