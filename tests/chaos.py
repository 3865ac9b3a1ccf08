"""A chaos monkey for end-to-end runs: `kill -9` of engine and trainer processes at seeded
random moments, each aimed at one phase of the RL step.

Ray names a worker process after its actor and the method it is running
(`ray::TrainActor.train`, `ray::EngineActor.receive_weights`), so the monkey finds a process in
the phase it wants by its command line, as an operator with `ps` would, and kills it with
SIGKILL. Nothing in the run knows the monkey is there.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

# phase -> (victim's actor, titles that mean the phase is under way). "reward": an engine dies
# while the rollout manager is scoring and assembling the batch.
PHASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "rollout": ("EngineActor", ("ray::EngineActor.generate",)),
    "reward": ("EngineActor", ("ray::RolloutManager.take",)),
    "train": ("TrainActor", ("ray::TrainActor.train",)),
    "sync": (
        "EngineActor",
        (
            "ray::EngineActor.receive_weights",
            "ray::EngineActor.load_bucket",  # colocated: buckets handed over in place
            "ray::TrainActor.send_weights",
        ),
    ),
    "checkpoint": ("TrainActor", ("ray::TrainActor.save",)),
}


@dataclass(frozen=True)
class Kill:
    phase: str
    pid: int
    victim: str  # the victim's command line when it was killed
    at: float  # time.time()


def ray_processes(session: int) -> dict[int, str]:
    """pid -> command line of every Ray worker of the run whose session id is `session` (the
    run's own Ray is started from it, so its workers share it; other runs' do not)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().split(b"\0", 1)[0].decode(errors="replace")
            if os.getsid(int(entry)) != session:
                continue
        except OSError:
            continue
        if title.startswith("ray::"):
            found[int(entry)] = title
    return found


@dataclass
class ChaosMonkey:
    """Kills `len(phases)` processes of the run in session `session` (start it with
    `start_new_session=True`; its pid is the session id), one per entry of `phases`, in that
    order, with a random pause (seeded) before each; a phase that does not come up within
    `patience_s` is skipped."""

    session: int
    phases: list[str]
    seed: int
    pause_s: tuple[float, float] = (1.0, 4.0)
    patience_s: float = 60.0
    kills: list[Kill] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ChaosMonkey:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        for phase in self.phases:
            if self._stop.wait(self._rng.uniform(*self.pause_s)):
                return
            kill = self._kill_in(phase)
            if kill is None:
                self.skipped.append(phase)
            else:
                self.kills.append(kill)

    def _kill_in(self, phase: str) -> Kill | None:
        actor, titles = PHASES[phase]
        deadline = time.monotonic() + self.patience_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            procs = ray_processes(self.session)
            if any(t.startswith(titles) for t in procs.values()):
                victims = sorted(p for p, t in procs.items() if t.startswith(f"ray::{actor}"))
                # The one in the phase if it is a victim kind, else any of that kind.
                busy = [p for p in victims if procs[p].startswith(titles)]
                pid = self._rng.choice(busy or victims) if victims else None
                if pid is not None:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    return Kill(phase, pid, procs[pid], time.time())
            time.sleep(0.002)
        return None
