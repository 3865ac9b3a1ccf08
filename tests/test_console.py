"""What `miles run` prints: short human lines on a terminal, clean JSON lines on a pipe, and the
run's summary on stdout. The same short quickstart, once on a pseudo-terminal, once on pipes."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

from .conftest import MILES, _test_env, shared_ray

SHORT = ("steps=3", "warmstart.steps=12", "eval.data=null")
HEX_ID = re.compile(r"\b[0-9a-f]{16,}\b")


def _args(run_dir: Path) -> list[str]:
    sets = [a for s in SHORT for a in ("--set", s)]
    return [*MILES, "run", "quickstart", "--run-dir", str(run_dir), *sets]


def _env() -> dict[str, str]:
    env = {**_test_env(), "RAY_AUTH_MODE": "token", "COLUMNS": "120"}
    env.pop("CI", None)  # as a person's shell
    return env


def test_on_a_terminal_lines_are_short_and_for_a_person(tmp_path: Path) -> None:
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 120 columns
    proc = subprocess.Popen(
        [*_args(tmp_path / "run"), "--ray-address", shared_ray()],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=_env(),
        start_new_session=True,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1.0)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the other end closed: the run is over
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode(errors="replace")[-4000:]
    text = b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")
    lines = [line for line in re.split(r"[\r\n]", text) if line.strip()]
    logs = [line for line in lines if re.match(r"\d\d:\d\d:\d\d ", line)]
    assert logs, text[-3000:]
    # No trace or span ids, no node ids, no line longer than a wide terminal.
    assert not any(HEX_ID.search(line) for line in logs), [x for x in logs if HEX_ID.search(x)]
    assert all(len(line) <= 240 for line in logs), max(logs, key=len)
    placement = next(line for line in logs if " placement " in line)
    assert "where=" in placement and "train 0 on " in placement, placement
    # The warm-start's losses stay in events.jsonl; the console gets one line for it.
    assert not any("warm-start step" in line for line in logs)
    assert any("warm-start done" in line for line in logs)
    events = (tmp_path / "run" / "events.jsonl").read_text()
    assert '"warm-start step"' in events and '"trace_id"' in events
    assert "RL steps" in text  # the bar, on a terminal
    assert "run finished:" in text


def test_on_a_pipe_stderr_is_json_lines_and_the_summary_is_on_stdout(tmp_path: Path) -> None:
    lora = ["--set", "lora.rank=8", "--set", "lora.sync=adapters"]  # its note is in the summary
    done = subprocess.run(
        [*_args(tmp_path / "run"), *lora, "--ray-address", shared_ray()],
        capture_output=True, text=True, env=_env(), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    for line in done.stderr.splitlines():  # every line parses: no bar glued to a log line
        if line.strip():
            json.loads(line)
    events = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    assert "RL steps" not in done.stderr
    steps = [e for e in events if e["event"] == "step"]
    assert steps and steps[-1]["step"] == "3/3", steps  # the plain step line
    # One numbering: the step line's 3/3 is metrics.jsonl's step 3, and checkpoints/step_3.
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "step_3" / "state.json").is_file()
    [summary] = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
    assert summary["event"] == "run finished" and "rollout/reward_mean" in summary["metrics"]
    assert any("LoRA on the quickstart" in note for note in summary["notes"]), summary
