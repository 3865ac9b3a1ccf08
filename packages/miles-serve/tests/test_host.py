"""`miles serve`'s engine host: how many engine calls run at once. The engine here is a double
that holds every call until released, so the host's scheduling is seen without timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from miles.core.contracts.types import GenerateRequest, GenerateResult, SamplingParams
from miles.serve.host import EngineHost, Finished


class HeldEngine:
    """An engine whose calls each wait for `release`; it records each call's request ids."""

    weight_version = 0

    def __init__(self, path: str) -> None:
        self.path = path
        self.calls: list[list[int]] = []
        self.release = threading.Event()

    def generate(self, requests: list[GenerateRequest], **_: Any) -> Iterator[list[GenerateResult]]:
        self.calls.append([r.request_id for r in requests])
        self.release.wait(timeout=30)
        yield [GenerateResult(r.request_id, [7], [-0.5], "length", 0) for r in requests]

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


def _wait_for(condition: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize(("path", "concurrent"), [("paged", 6), ("hf", 1)])
def test_a_request_arriving_mid_batch_starts_at_once_on_the_paged_path(path, concurrent):
    """Paged: each arrival starts its own call (the engine merges calls into one schedule), so it
    joins the running batch at the next step; with a cap of four calls the fifth and sixth
    waited for a call to end. hf: one call at a time, the next takes what queued meanwhile."""
    engine = HeldEngine(path)
    host = EngineHost(engine, max_batch_size=8)
    answers: list[Finished] = []
    try:
        for i in range(6):  # one at a time: each is its own burst
            host.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=4), answers.append)
            _wait_for(lambda n=i + 1: sum(map(len, engine.calls)) == n, seconds=0.5)
        assert _wait_for(lambda: len(engine.calls) >= concurrent), engine.calls
        time.sleep(0.2)  # no more calls start while these are held
        assert len(engine.calls) == concurrent, engine.calls
        assert not answers
        engine.release.set()
        assert _wait_for(lambda: len(answers) == 6)
        assert sorted(a.rid for a in answers) == [f"r{i}" for i in range(6)]
        assert all(a.response_ids == [7] and a.finish_reason == "length" for a in answers)
    finally:
        engine.release.set()
        host.close()
