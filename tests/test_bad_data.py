"""Bad data stops `miles run` before Ray or any actor starts, with every bad row's file and line;
`data.drop_long_prompts` drops the prompts too long for the model instead, and says how many."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .conftest import read_jsonl, run_miles

SHORT = ("--set", "steps=1", "--set", "warmstart.steps=0", "--set", "eval.data=null")


def test_every_bad_row_is_reported_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        b"\n".join(
            [
                json.dumps({"prompt": "say 3", "answer": "3"}).encode(),
                b'{"prompt": "cut short", ',
                json.dumps({"question": "no prompt key", "answer": "1"}).encode(),
                json.dumps({"prompt": None, "answer": "1"}).encode(),
                b'{"prompt": "caf\xe9", "answer": "1"}',
                json.dumps({"prompt": "x " * 2000, "answer": "1"}).encode(),
            ]
        )
        + b"\n"
    )
    run_dir = tmp_path / "run"
    proc = run_miles(
        "run", "quickstart", "--run-dir", str(run_dir), "--set", f"data.path={bad}", *SHORT
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr
    for line, what in [
        (2, "not valid JSON"),
        (3, "no 'prompt' field (fields: answer, question); set data.prompt_key"),
        (4, "'prompt' is null"),
        (5, "not UTF-8: byte 0xe9"),
        (6, r"the prompt is \d+ tokens, more than the model's context of 64"),
    ]:
        assert re.search(
            re.escape(f"{bad}:{line}: ") + what.replace("(", r"\(").replace(")", r"\)"), err
        ), (line, err[-3000:])
    assert "Traceback" not in err and "ray" not in err.lower(), err[-3000:]
    assert not run_dir.exists()  # a refused run leaves nothing behind


def test_long_prompts_can_be_dropped_and_are_counted(tmp_path: Path) -> None:
    rows = [{"prompt": f"say {n}", "answer": str(n)} for n in range(4)]
    rows.insert(2, {"prompt": "x " * 2000, "answer": "1"})
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    run_dir = tmp_path / "run"
    proc = run_miles(
        "run", "quickstart", "--run-dir", str(run_dir), "--set", f"data.path={data}",
        "--set", "data.drop_long_prompts=true", *SHORT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])  # on stdout; JSON on a pipe
    assert summary["metrics"]["data/dropped_long_prompts"] == 1.0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["data/dropped_long_prompts"] for m in metrics if "step" in m][:1] == [1.0]


def test_an_error_in_an_actor_reaches_the_console_as_one_line(tmp_path: Path) -> None:
    """A reward that fails inside the rollout actor (the code reward finds no `tests` field in
    the quickstart's rows): the console gets its cause in one line and where the traceback is,
    never Ray's wrapper or its colour codes; events.jsonl keeps the whole traceback."""
    run_dir = tmp_path / "run"
    proc = run_miles(
        "run", "quickstart", "--run-dir", str(run_dir),
        "--set", "reward={name: code, on_error: fail}", *SHORT,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "error: the run failed: RewardError: reward 'code': KeyError" in err, err[-3000:]
    assert f"details: {run_dir / 'events.jsonl'}" in err
    assert "Traceback" not in err and "RayTaskError" not in err and "\x1b" not in err, err[-3000:]
    failed = [e for e in read_jsonl(run_dir / "events.jsonl") if e.get("event") == "run failed"]
    assert failed and "Traceback" in failed[0]["exception"]
    assert "\x1b" not in json.dumps(failed[0])
